"""Fixtures of the contract tests: every check runs in worker processes of the graded code
(``cs336_systems.grading``), this process only collects, runs workers and reports.

The adapters file under test: ``--adapters PATH`` or ``CS336_ADAPTERS``, else the suite's own
``tests/adapters.py``. Each test carries ``@pytest.mark.hook(...)`` and ``@pytest.mark.tier(...)``; the
grading summary (``grading.summary``) counts it under each hook and tier.
"""

from __future__ import annotations

import pytest

from cs336_systems.grading.pytest_plugin import ROOTS
from cs336_systems.grading.roots import StudentRoots
from cs336_systems.grading.runner import CaseRuns
from cs336_systems.grading.summary import HOOKS_PROPERTY, TIER_PROPERTY

WORKER_TIMEOUT_S = 240.0


@pytest.fixture(scope="session")
def roots(pytestconfig: pytest.Config) -> StudentRoots:
    return pytestconfig.stash[ROOTS]


@pytest.fixture
def suite_self_check(roots: StudentRoots) -> None:
    """For tests of the contract suite itself (planted bugs, bench rows): skipped while grading
    another implementation, where they would only cost the student time."""
    if not roots.self_grade:
        pytest.skip("a self-check of the contract suite; runs without --adapters")


@pytest.fixture(scope="session")
def case_runs(roots: StudentRoots) -> CaseRuns:
    return CaseRuns(roots, WORKER_TIMEOUT_S)


@pytest.fixture
def verdict(request: pytest.FixtureRequest, case_runs: CaseRuns):
    """``verdict(module, case)``: the case's result from the workers, as this test's outcome. The
    module's other selected cases at the same world size run in the same workers."""

    def check(module: str, case: dict) -> None:
        ws = case.get("world_size", 1)
        selected = [
            item.callspec.params["case"]["id"]
            for item in request.session.items
            if getattr(item, "function", None) is request.function
            and item.callspec.params["case"].get("world_size", 1) == ws
        ]
        result = case_runs.verdict(module, case["id"], selected, ws)
        if result["status"] == "skipped":
            pytest.skip(result["message"])
        if result["status"] != "passed":
            pytest.fail(result["message"], pytrace=False)

    return check


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # user_properties travel with the reports (to the xdist controller too), the markers do not.
    for item in items:
        hook, tier = item.get_closest_marker("hook"), item.get_closest_marker("tier")
        if hook is not None:
            item.user_properties.append((HOOKS_PROPERTY, tuple(hook.args)))
            item.user_properties.append((TIER_PROPERTY, tier.args[0] if tier else "course"))


@pytest.fixture(autouse=True)
def _skip_blank_hooks(request: pytest.FixtureRequest, pytestconfig: pytest.Config) -> None:
    """A test whose hooks include a blank one (the course's template) skips, naming it, before any
    worker starts (known from the probe when grading another file)."""
    from cs336_systems.grading.pytest_plugin import PROBE

    marker, probe = request.node.get_closest_marker("hook"), pytestconfig.stash.get(PROBE, None)
    if marker is None or probe is None:
        return
    for name in marker.args:
        if probe["blank"].get(name):
            pytest.skip(probe["blank"][name])
