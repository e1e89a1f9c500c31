"""Fixtures of the contract tests: every hook runs in worker processes of the graded code, and this
process makes the inputs, computes the references and decides (``cs336_systems.grading``). This is the
pytest front end of the judging process; ``python -m cs336_systems.grading.judge`` runs the same cases
through the same ``Grader`` and report without pytest (``grading/judge/judging.py``).

The adapters file under test: ``--adapters PATH`` or ``CS336_ADAPTERS``, else the suite's own
``tests/adapters.py``. Each test carries ``@pytest.mark.hook(...)`` and ``@pytest.mark.tier(...)`` and
records its case's verdict for the report (``grading.judge.summary``). With ``--adapters``, only the hook
tests of the file's edition are collected: the suite's self-checks would only cost the student time.
"""

from __future__ import annotations

import pytest

from cs336_systems.grading.judge.judging import tier_selected
from cs336_systems.grading.judge.pytest_plugin import (
    CASE_PROPERTY,
    PROBE,
    ROOTS,
    SEED,
    grading_jobs,
    grading_limits,
    requested_adapters,
)
from cs336_systems.grading.judge.session import Grader
from cs336_systems.grading.judge.summary import case_entry
from cs336_systems.grading.roots import StudentRoots
from cs336_systems.grading.shared.cases import UNFINISHED_HERE, Case
from cs336_systems.grading.verdict import FAILED, SKIPPED

# The suite's own hooks in its own tests get twice a student's worker limit: on a busy CI machine (a load of
# 5 on 2 cores) the PyTorch attention's course batch alone ran past 240 s.
SELF_CHECK_FACTOR = 2


@pytest.fixture(scope="session")
def roots(pytestconfig: pytest.Config) -> StudentRoots:
    return pytestconfig.stash[ROOTS]


@pytest.fixture(scope="session")
def grader(request: pytest.FixtureRequest, pytestconfig: pytest.Config, roots: StudentRoots):
    """The run's grader, planned with every selected case (its jobs start at once when side by side)."""
    stash = pytestconfig.stash
    worker_s = grading_limits(pytestconfig).worker_s
    timeout = SELF_CHECK_FACTOR * worker_s if roots.self_grade else worker_s
    found = Grader(roots, stash[PROBE], stash[SEED], timeout, jobs=grading_jobs(pytestconfig))
    found.plan([c for item in request.session.items if isinstance(c := _case_of(item), Case)])
    yield found
    found.close()


def _case_of(item: pytest.Item) -> object:
    return getattr(item, "callspec", None) and item.callspec.params.get("case")


@pytest.fixture
def verdict(request: pytest.FixtureRequest, grader: Grader, roots: StudentRoots):
    """``verdict(case)``: the case's verdict as this test's outcome (``Grader.batch_key`` says which
    other selected cases run in the same workers). A case the machine was too busy to finish is a skip
    for a student's code (not scored) but a failure of the suite's own tests: skipped, a break in the
    suite's hooks would pass unseen on a busy CI machine."""

    def check(case: Case) -> None:
        result = grader.verdict(case)
        entry = case_entry(case, result, grader.worker_seconds(case.id))
        request.node.user_properties.append((CASE_PROPERTY, entry))
        if result.status == SKIPPED and result.kind == UNFINISHED_HERE and roots.self_grade:
            pytest.fail(f"the machine was too busy to check the suite's own case: {result.message}", False)
        if result.status == SKIPPED:
            pytest.skip(result.message)
        if result.status == FAILED:
            pytest.fail(result.message, pytrace=False)
        if result.status != "passed":
            pytest.fail(f"cannot grade ({result.kind}): {result.message}", pytrace=False)

    return check


def _other_edition(item: pytest.Item, probe) -> bool:
    """A hook test whose hooks the file does not have at all (a 1.0.5 file has no get_fsdp)."""
    marker = item.get_closest_marker("hook")
    return marker is not None and probe.absent(marker.args)


def _tier_unwanted(item: pytest.Item, tiers: str | None) -> bool:
    marker = item.get_closest_marker("tier")
    return marker is not None and not tier_selected(marker.args[0], tiers)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers = config.getoption("--grade-tiers", None)
    unwanted = [i for i in items if _tier_unwanted(i, tiers)]
    if unwanted:
        config.hook.pytest_deselected(items=unwanted)
        items[:] = [i for i in items if i not in unwanted]
    probe = config.stash.get(PROBE, None)
    if probe is None or requested_adapters(config) is None:
        return
    keep = [
        i
        for i in items
        if (i.get_closest_marker("hook") is not None or "contract" not in str(i.path))
        and not _other_edition(i, probe)
    ]
    dropped = [i for i in items if i not in keep]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


@pytest.fixture
def suite_self_check(roots: StudentRoots) -> None:
    """For tests of the contract suite itself (planted bugs, fixtures, bench rows)."""
    if not roots.self_grade:
        pytest.skip("a self-check of the contract suite; runs without --adapters")
