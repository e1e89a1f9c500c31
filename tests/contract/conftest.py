"""Fixtures of the contract tests, and the per-hook summary a grader reads at the end of the run.

The adapters file under test: ``--adapters PATH`` or ``CS336_ADAPTERS`` (declared in the root
conftest), else the suite's own ``tests/adapters.py``. Every test names the hooks it exercises with
``@pytest.mark.hook(...)``; the summary (``harness.adapters.HookSummary``, registered by the root
conftest so that it also prints in a whole-suite run under xdist) counts each test under each hook.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_systems.distributed.launch import spawn
from cs336_systems.harness.adapters import HOOKS_PROPERTY, blank_hook

from .contract import DEFAULT_ADAPTERS, Hooks, SpawnCache

SPAWN_TIMEOUT_S = 120.0


@pytest.fixture(scope="session")
def adapters_under_test(adapters_file: Path | None) -> Path:
    return adapters_file or DEFAULT_ADAPTERS


@pytest.fixture
def suite_self_check(adapters_under_test: Path) -> None:
    """For tests of the contract suite itself (planted bugs, bench rows): skipped while grading
    another adapters file, where they would only cost the student time."""
    if adapters_under_test.resolve() != DEFAULT_ADAPTERS.resolve():
        pytest.skip("a self-check of the contract suite; runs without --adapters")


@pytest.fixture(scope="session")
def hooks(adapters_under_test: Path) -> Hooks:
    return Hooks(adapters_under_test)


@pytest.fixture(scope="session")
def spawned() -> SpawnCache:
    """Per-rank results of a rank function on N gloo ranks, spawned once per session and arguments."""
    return SpawnCache(spawn, SPAWN_TIMEOUT_S)


@pytest.fixture(autouse=True)
def _skip_blank_hooks(request: pytest.FixtureRequest) -> None:
    """A test whose hooks include a missing or blank one (the course's template) skips, naming it,
    before any rank is spawned."""
    marker = request.node.get_closest_marker("hook")
    if marker is None:
        return
    hooks: Hooks = request.getfixturevalue("hooks")
    for name in marker.args:
        blank = blank_hook(hooks.module, name)
        if blank is not None:
            pytest.skip(blank.skip_reason)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # user_properties travel with the reports (to the xdist controller too), the markers do not.
    for item in items:
        marker = item.get_closest_marker("hook")
        if marker is not None:
            item.user_properties.append((HOOKS_PROPERTY, tuple(marker.args)))
