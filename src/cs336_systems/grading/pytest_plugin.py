"""The grading options and report, as a pytest plugin loaded before any conftest (``-p`` in the
project's ``addopts``): an option pytest does not know yet would make it read ``--adapters PATH``'s
PATH as a test path, and import the student's ``tests/conftest.py`` from it.

``--adapters PATH`` (or ``CS336_ADAPTERS``) names the adapters file to grade; ``--repo-root``,
``--package-root`` and ``--basics-root`` override where its code is found; ``--grade-json`` writes the
report; ``--grade-seed`` fixes the run's inputs (fresh ones every run otherwise). Before any test runs,
the file's source is read for blank hooks (``probe``) and one worker loads it: if it cannot (missing, a
directory, a syntax error, a missing dependency), the run stops with that one line.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from .settings import adapters_from_env, loaded_before, mark_loaded, share_seed, shared_seed

DEFAULT_ADAPTERS = "tests/adapters.py"
OPTIONS = {
    "--adapters": "an adapters file to grade and benchmark (env CS336_ADAPTERS); the contract tests default "
    "to the suite's tests/adapters.py, the benches add an 'adapters' row only when it is given",
    "--repo-root": "the graded repository's root (default: the folder above the adapters file holding pyproject.toml)",
    "--package-root": "the folder holding the graded cs336_systems (default: module-root in pyproject.toml, src/ or the repo root)",
    "--basics-root": "the folder holding the graded cs336_basics (default: [tool.uv.sources] cs336-basics in pyproject.toml)",
    "--grade-json": "write the report (groups, tiers, every case's verdict and message, the seed) to this JSON file",
    "--grade-seed": "the seed of the run's inputs (default: fresh each run; the report records it)",
    "--grade-progress": "append one JSON line per graded case to this file as the run goes (a class run's progress)",
}
ROOTS = pytest.StashKey()
PROBE = pytest.StashKey()
SEED = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336 grading")
    for flag, help_text in OPTIONS.items():
        group.addoption(flag, default=None, metavar="N" if flag == "--grade-seed" else "PATH", help=help_text)
    group.addoption(
        "--grade-tiers",
        default=None,
        metavar="TIERS",
        help="grade only these tiers, comma-separated (course, leaderboard, beyond; default: all)",
    )
    group.addoption(
        "--grade-jobs",
        type=int,
        default=None,
        metavar="N",
        help="worker jobs of the graded code side by side, all started before the first verdict "
        "(default: 4 with a GPU, else half the CPU cores up to 4; 1 in a pytest-xdist worker)",
    )
    group.addoption(
        "--grade-summary",
        choices=("table", "none"),
        default="table",
        help="print the hook x tier table at the end (none: the report goes to --grade-json only)",
    )


def requested_adapters(config: pytest.Config) -> Path | None:
    value = config.getoption("--adapters") or adapters_from_env()
    return Path(value).expanduser().resolve() if value else None


def student_roots(config: pytest.Config, adapters: Path):
    from .roots import discover

    return discover(
        adapters, *(config.getoption(f) for f in ("--repo-root", "--package-root", "--basics-root"))
    )


def grading_jobs(config: pytest.Config) -> int:
    """How many worker jobs run side by side (``--grade-jobs``). A pytest-xdist worker runs its
    groups' jobs one at a time: the workers are the parallelism there."""
    if hasattr(config, "workerinput"):
        return 1
    if (asked := config.getoption("--grade-jobs", None)) is not None:
        return max(1, asked)
    import torch

    return 4 if torch.cuda.is_available() else max(1, min(4, (os.cpu_count() or 1) // 2))


def check_loads(roots) -> None:
    """One worker imports the adapters file; the run stops with one line when it cannot."""
    from .runner import Job, run

    got = run(Job(roots, "load", timeout=180))
    record = got.records.get(("load", 0))
    if got.job_problem is None and record is not None and record.get("status") == "loaded":
        return
    if got.job_problem:
        why = got.job_problem
    elif record is not None and record.get("status") == "load-error":
        why = record.get("message")
    elif record is not None:
        why = f"the load check's record was rewritten (status {record.get('status')!r}, not 'loaded')"
    else:
        why = got.problems.get(("load", 0), "no record of the load check")
    raise pytest.UsageError(f"cannot grade {roots.adapters}: {why}")


def _seed(config: pytest.Config) -> int:
    from .session import fresh_seed

    value = config.getoption("--grade-seed")
    seed = int(value) if value else shared_seed()
    seed = fresh_seed() if seed is None else seed
    share_seed(seed)
    return seed


def pytest_configure(config: pytest.Config) -> None:
    from .probe import probe
    from .roots import SUITE_ROOT, GradingSetupError
    from .summary import GradeSummary

    config.addinivalue_line("markers", "hook(*names): a contract test of these grading hooks")
    config.addinivalue_line(
        "markers", "tier(name): the contract tier of a test: course, leaderboard or beyond"
    )
    adapters = requested_adapters(config)
    try:
        roots = student_roots(config, adapters or SUITE_ROOT / DEFAULT_ADAPTERS)
    except GradingSetupError as exc:
        raise pytest.UsageError(str(exc)) from None
    config.stash[ROOTS] = roots
    config.stash[PROBE] = probe(roots.adapters)
    if adapters is not None and not loaded_before(str(roots.adapters)):
        check_loads(roots)
        mark_loaded(str(roots.adapters))
    grade_json = config.getoption("--grade-json")
    config.stash[SEED] = _seed(config)
    summary = GradeSummary(
        external=adapters is not None and not roots.self_grade,
        grade_json=Path(grade_json) if grade_json else None,
        seed=config.stash[SEED],
        adapters=str(roots.adapters),
        show=config.getoption("--grade-summary") == "table",
        progress=Path(progress) if (progress := config.getoption("--grade-progress")) else None,
        isolation=_isolation(config, grade_json),
    )
    if not hasattr(config, "workerinput"):  # the xdist controller (or a plain run) reports; workers compute
        config.pluginmanager.register(summary, "cs336-grade-summary")


def _isolation(config: pytest.Config, grade_json: str | None) -> dict | None:
    """A run writing a report of another implementation in one process (no pytest-xdist workers, whose
    own processes are this one's children) is a subreaper: whatever the graded code leaves behind is
    re-parented here and killed before ``grade.json`` is written. What isolation the workers had."""
    if not grade_json or config.getoption("numprocesses", None) not in (None, 0):
        return None
    from .sandbox import Sandbox, become_subreaper

    become_subreaper()
    return Sandbox.from_env().isolation()


def unimplemented(config: pytest.Config, hooks: tuple[str, ...]) -> str | None:
    """Why a bench row needing ``hooks`` cannot run (its first hook with no implemented alternative,
    ``"a|b"`` meaning either), from the adapters file's source; None when all are there."""
    found = config.stash.get(PROBE, None)
    if found is None:
        return None
    for alternatives in hooks:
        reasons = [found.reason(h) for h in alternatives.split("|")]
        if all(reasons):
            return reasons[0]
    return None
