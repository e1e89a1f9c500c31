"""The grading options and report, as a pytest plugin loaded before any conftest (``-p`` in the
project's ``addopts``): an option pytest does not know yet would make it read ``--adapters PATH``'s
PATH as a test path, and import the student's ``tests/conftest.py`` from it.

``--adapters PATH`` (or ``CS336_ADAPTERS``) names the adapters file to grade; ``--repo-root``,
``--package-root`` and ``--basics-root`` override where its code is found; ``--grade-json`` writes the
per-hook report. Before any test runs, one worker loads the adapters file: if it cannot (missing, a
directory, a syntax error, a missing dependency), the run stops with that one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from .settings import adapters_from_env, cache_probe, cached_probe

DEFAULT_ADAPTERS = "tests/adapters.py"
OPTIONS = {
    "--adapters": "an adapters file to grade and benchmark (env CS336_ADAPTERS); the contract tests default "
    "to the suite's tests/adapters.py, the benches add an 'adapters' row only when it is given",
    "--repo-root": "the graded repository's root (default: the folder above the adapters file holding pyproject.toml)",
    "--package-root": "the folder holding the graded cs336_systems (default: module-root in pyproject.toml, src/ or the repo root)",
    "--basics-root": "the folder holding the graded cs336_basics (default: [tool.uv.sources] cs336-basics in pyproject.toml)",
    "--grade-json": "write the per-hook, per-tier results (with each failure's message) to this JSON file",
}


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336 grading")
    for flag, help_text in OPTIONS.items():
        group.addoption(flag, default=None, metavar="PATH", help=help_text)


def requested_adapters(config: pytest.Config) -> Path | None:
    value = config.getoption("--adapters") or adapters_from_env()
    return Path(value).expanduser().resolve() if value else None


def student_roots(config: pytest.Config, adapters: Path):
    from .roots import discover

    return discover(
        adapters, *(config.getoption(f) for f in ("--repo-root", "--package-root", "--basics-root"))
    )


def _probe(roots) -> dict:
    from .runner import run_job

    (payload,) = run_job(roots, "probe", {}, timeout=120)
    if "error" in payload:
        raise pytest.UsageError(f"cannot grade {roots.adapters}: {payload['error']}")
    return payload["result"]


def pytest_configure(config: pytest.Config) -> None:
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
    probe = None
    if adapters is not None:
        probe = cached_probe(str(adapters)) or _probe(roots)
        cache_probe(str(adapters), probe)
    config.stash[PROBE] = probe
    grade_json = config.getoption("--grade-json")
    external = adapters is not None and not roots.self_grade
    config.pluginmanager.register(
        GradeSummary(external, Path(grade_json) if grade_json else None, probe), "cs336-grade-summary"
    )


ROOTS = pytest.StashKey()
PROBE = pytest.StashKey()


def unimplemented(config: pytest.Config, hooks: tuple[str, ...]) -> str | None:
    """Why a bench row needing ``hooks`` cannot run (its first hook with no implemented alternative,
    ``"a|b"`` meaning either), from the probe of the adapters file; None when all are there."""
    blank = (config.stash.get(PROBE, None) or {}).get("blank", {})
    for alternatives in hooks:
        reasons = [blank.get(h, f"{h}: not implemented (not a known hook)") for h in alternatives.split("|")]
        if all(reasons):
            return reasons[0]
    return None
