"""Fixtures of the contract tests, and the per-hook summary a grader reads at the end of the run.

The adapters file under test: ``--adapters PATH`` or ``CS336_ADAPTERS`` (declared in the root
conftest), else the suite's own ``tests/adapters.py``. Every test names the hooks it exercises with
``@pytest.mark.hook(...)``; the summary counts each test under each of its hooks.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

import pytest

from cs336_systems.distributed.launch import spawn
from cs336_systems.harness.adapters import blank_hook

from .contract import DEFAULT_ADAPTERS, Hooks, SpawnCache

SPAWN_TIMEOUT_S = 120.0
_OUTCOMES = ("passed", "failed", "skipped")
_SUMMARY = "cs336-contract-summary"


@pytest.fixture(scope="session")
def adapters_under_test(adapters_file: Path | None) -> Path:
    return adapters_file or DEFAULT_ADAPTERS


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
            item.user_properties.append(("contract_hooks", tuple(marker.args)))


class HookSummary:
    """Counts outcomes per hook from the test reports, and prints one line per hook at the end."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        hooks = dict(report.user_properties).get("contract_hooks")
        # one count per test: its call phase, or the setup / teardown phase that failed or skipped
        if hooks is None or (report.when != "call" and report.outcome == "passed"):
            return
        for hook in hooks:
            self.counts[hook][report.outcome] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.counts:
            return
        terminalreporter.write_sep("=", "contract summary per hook")
        width = max(map(len, self.counts))
        for hook in sorted(self.counts):
            c = self.counts[hook]
            verdict = "FAIL" if c["failed"] else ("ok" if c["passed"] else "not implemented / skipped")
            cells = "  ".join(f"{c[o]:3d} {o}" for o in _OUTCOMES)
            terminalreporter.write_line(f"{hook:<{width}}  {cells}  {verdict}")


def pytest_configure(config: pytest.Config) -> None:
    if not config.pluginmanager.has_plugin(_SUMMARY):
        config.pluginmanager.register(HookSummary(), _SUMMARY)
