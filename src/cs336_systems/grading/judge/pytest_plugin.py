"""The grading options and report, as a pytest plugin loaded before any conftest (``-p`` in the
project's ``addopts``): an option pytest does not know yet would make it read ``--adapters PATH``'s
PATH as a test path, and import the student's ``tests/conftest.py`` from it.

pytest is one front end of the judging process (``python -m cs336_systems.grading.judge`` is the other,
the one ``repo_job`` runs): the same options (``options.OPTIONS``), the same ``Grader`` (built in
``tests/contract/conftest.py``), the same report (``summary.Recorder``). ``--adapters PATH`` (or
``CS336_ADAPTERS``) names the adapters file to grade; ``--repo-root``, ``--package-root`` and
``--basics-root`` override where its code is found; ``--grade-json`` writes the report; ``--grade-seed``
fixes the run's inputs (fresh ones every run otherwise). Before any test runs, the file's source is read
for blank hooks (``probe``) and one worker loads it: if it cannot (missing, a directory, a syntax error,
a missing dependency), the run stops with that one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ..limits import Limits
from ..settings import adapters_from_env, loaded_before, mark_loaded
from .options import OPTIONS

DEFAULT_ADAPTERS = "tests/adapters.py"
CASE_PROPERTY = "grade_case"  # the user_properties key of a case's entry (they travel to xdist's controller)
ROOTS = pytest.StashKey()
PROBE = pytest.StashKey()
SEED = pytest.StashKey()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336 grading")
    for option in OPTIONS:
        group.addoption(option.flag, **option.kwargs())


def requested_adapters(config: pytest.Config) -> Path | None:
    value = config.getoption("--adapters") or adapters_from_env()
    return Path(value).expanduser().resolve() if value else None


def student_roots(config: pytest.Config, adapters: Path):
    from ..roots import discover

    return discover(
        adapters, *(config.getoption(f) for f in ("--repo-root", "--package-root", "--basics-root"))
    )


def grading_limits(config: pytest.Config) -> Limits:
    """The repository's time limit (``--grade-timeout``) and the shares of it its workers get."""
    asked = config.getoption("--grade-timeout", None)
    return Limits(asked) if asked is not None else Limits()


def grading_jobs(config: pytest.Config) -> int:
    """How many worker jobs run side by side (``--grade-jobs``). A pytest-xdist worker runs its
    groups' jobs one at a time: the workers are the parallelism there."""
    if hasattr(config, "workerinput"):
        return 1
    if (asked := config.getoption("--grade-jobs", None)) is not None:
        return max(1, asked)
    from .session import default_jobs

    return default_jobs()


class GradeSummary:
    """Collects each contract test's case entry (``summary.Recorder``); prints the table
    (``--grade-summary table``) and writes ``--grade-json`` at the end of the run; sets the exit status
    when another implementation is graded."""

    def __init__(self, recorder, external: bool, grade_json: Path | None, show: bool, isolation: dict | None):
        self.recorder, self.external, self.grade_json, self.show = recorder, external, grade_json, show
        self.isolation = isolation  # set when this run is a subreaper: leftovers killed before grade.json

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.when != "call":  # the verdict is recorded in the call; teardown's report repeats it
            return
        for key, value in report.user_properties:
            if key == CASE_PROPERTY:
                self.recorder.add(value)

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.recorder.cases or not self.show:
            return
        from .summary import render

        terminalreporter.write_sep("=", "grading summary: hook x tier (passed/failed/skipped)")
        for line in render(self.recorder.report()):
            terminalreporter.write_line(line)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        # Written here, not in the terminal summary: pytest before 8.4 skips that hook under --no-summary.
        self.recorder.write(self.grade_json, self.isolation)
        if (
            self.recorder.cases
            and self.external
            and exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.TESTS_FAILED)
        ):
            from .summary import exit_status

            session.exitstatus = exit_status(self.recorder.report(), True, exitstatus)


def pytest_configure(config: pytest.Config) -> None:
    from ..probe import probe
    from ..roots import SUITE_ROOT, GradingSetupError
    from .session import check_loads, run_seed
    from .summary import Recorder

    config.addinivalue_line("markers", "hook(*names): a contract test of these grading hooks")
    config.addinivalue_line(
        "markers", "tier(name): the contract tier of a test: course, leaderboard or beyond"
    )
    adapters = requested_adapters(config)
    try:
        roots = student_roots(config, adapters or SUITE_ROOT / DEFAULT_ADAPTERS)
        config.stash[ROOTS] = roots
        config.stash[PROBE] = probe(roots.adapters)
        if adapters is not None and not loaded_before(str(roots.adapters)):
            check_loads(roots, grading_limits(config))
            mark_loaded(str(roots.adapters))
    except GradingSetupError as exc:
        raise pytest.UsageError(str(exc)) from None
    grade_json = config.getoption("--grade-json")
    config.stash[SEED] = run_seed(config.getoption("--grade-seed"))
    progress = config.getoption("--grade-progress")
    summary = GradeSummary(
        Recorder(config.stash[SEED], str(roots.adapters), Path(progress) if progress else None),
        external=adapters is not None and not roots.self_grade,
        grade_json=Path(grade_json) if grade_json else None,
        show=config.getoption("--grade-summary") == "table",
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
    from .judging import isolation_here

    return isolation_here(Path(grade_json))


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
