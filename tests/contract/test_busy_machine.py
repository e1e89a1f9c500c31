"""A case the machine was too busy to finish ("could not grade here": a worker's limit reached at a load
far above the cores) is left out of a student's score, but never passes the suite's own tests by a skip:
there it fails, naming the load, so that a break in the suite's hooks cannot hide behind a busy CI
machine. The conftest's ``verdict`` fixture, run on a stand-in grader that always says so."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cs336_systems.grading.shared.cases import CASES, UNFINISHED_HERE
from cs336_systems.grading.verdict import Verdict

BUSY = "could not grade here: timed out after 240 s at load 4.9 on 2 cores"
CASE = next(iter(CASES.values()))


class _BusyGrader:
    def verdict(self, case) -> Verdict:
        return Verdict.skipped(UNFINISHED_HERE, BUSY)

    def worker_seconds(self, case_id: str) -> dict:
        return {}


@pytest.fixture
def grader() -> _BusyGrader:
    return _BusyGrader()


@pytest.fixture(params=[True, False], ids=["the suite's own hooks", "a student's"])
def roots(request: pytest.FixtureRequest) -> SimpleNamespace:
    return SimpleNamespace(self_grade=request.param)


def test_a_busy_machine_fails_the_suites_own_case_and_skips_a_students(
    request: pytest.FixtureRequest, verdict, roots
) -> None:
    outcome: BaseException | None = None
    try:  # caught here either way: a skip escaping this test would pass as a skip, hiding the break
        verdict(CASE)
    except (pytest.fail.Exception, pytest.skip.Exception) as raised:
        outcome = raised
    finally:
        request.node.user_properties.clear()  # the stand-in's verdict is no case of this run's report
    expected = pytest.fail.Exception if roots.self_grade else pytest.skip.Exception
    assert type(outcome) is expected, f"{type(outcome).__name__}: {outcome}"
    assert "load 4.9 on 2 cores" in str(outcome)
    assert ("too busy" in str(outcome)) == roots.self_grade, outcome
