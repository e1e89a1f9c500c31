"""The grader's report: one row per hook, one column per tier (passed / failed / skipped), the failures
with their messages, optionally as JSON (``--grade-json``); and the exit status, which only a ``course``
failure makes non-zero when another implementation is graded."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from pathlib import Path

import pytest

HOOKS_PROPERTY, TIER_PROPERTY = "contract_hooks", "contract_tier"
TIERS = ("course", "leaderboard", "beyond")
NOT_IMPLEMENTED = "not implemented"


def skip_kind(report: pytest.TestReport) -> str:
    """Why a test skipped: the hook is not implemented, the machine lacks a GPU, or something else."""
    reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else report.longrepr)
    if NOT_IMPLEMENTED in reason:
        return "blank"
    return "gpu" if "CUDA GPU" in reason or "refuses CPU" in reason else "other"


class GradeSummary:
    """Counts each contract test once per hook and tier (its call phase, or the setup phase that
    skipped or failed), and prints the table at the end of the run."""

    def __init__(self, external: bool, grade_json: Path | None, probe: dict | None):
        self.external, self.grade_json, self.probe = external, grade_json, probe
        self.counts: dict[str, dict[str, Counter]] = defaultdict(lambda: defaultdict(Counter))
        self.failures: dict[str, list[dict]] = defaultdict(list)
        self.other_failures = 0

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        props = dict(report.user_properties)
        hooks, tier = props.get(HOOKS_PROPERTY), props.get(TIER_PROPERTY, "course")
        counted = report.when == "call" or report.outcome != "passed"
        if report.when == "teardown" and report.outcome == "skipped":
            counted = False
        if not counted:
            return
        if hooks is None:
            self.other_failures += report.outcome == "failed"
            return
        outcome = report.outcome if report.outcome != "skipped" else f"skipped:{skip_kind(report)}"
        for hook in hooks:
            self.counts[hook][tier][outcome] += 1
            if report.outcome == "failed":
                message = str(
                    (getattr(report.longrepr, "reprcrash", None) and report.longrepr.reprcrash.message)
                    or report.longrepr
                )
                self.failures[hook].append({"test": report.nodeid, "tier": tier, "message": message})

    def verdict(self, hook: str) -> str:
        tiers = self.counts[hook]
        failed = [t for t in TIERS if tiers[t]["failed"]]
        passed = sum(c["passed"] for c in tiers.values())
        skip_kinds = {k for c in tiers.values() for k, n in c.items() if k.startswith("skipped") and n}
        if "course" in failed:
            return "FAIL"
        if failed:
            return "course ok; fails " + ", ".join(failed)
        if passed:
            return "ok"
        if "skipped:blank" in skip_kinds:
            return NOT_IMPLEMENTED
        return "needs a GPU: skipped here" if "skipped:gpu" in skip_kinds else "skipped"

    def table(self) -> dict:
        return {
            hook: {
                "verdict": self.verdict(hook),
                **{t: dict(self.counts[hook][t]) for t in TIERS},
                "failures": self.failures[hook],
            }
            for hook in self._hooks()
        }

    def _hooks(self) -> list[str]:
        defined = set(self.probe["defined"]) if self.probe else set(self.counts)
        return sorted(h for h in self.counts if h in defined)

    def _cell(self, c: Counter) -> str:
        skipped = sum(n for k, n in c.items() if k.startswith("skipped"))
        return f"{c['passed']:>3}/{c['failed']:<2}/{skipped:<3}" if c else "      -     "

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.counts:
            return
        write = terminalreporter.write_line
        terminalreporter.write_sep("=", "grading summary: hook x tier (passed/failed/skipped)")
        width = max(map(len, self.counts))
        write(f"{'hook':<{width}}  " + "  ".join(f"{t:^12}" for t in TIERS) + "  verdict")
        for hook in self._hooks():
            cells = "  ".join(self._cell(self.counts[hook][t]) for t in TIERS)
            write(f"{hook:<{width}}  {cells}  {self.verdict(hook)}")
        absent = sorted(set(self.counts) - set(self._hooks()))
        if absent:
            write(f"not in this adapters file (the other edition's hooks): {', '.join(absent)}")
        if self.grade_json:
            self.grade_json.parent.mkdir(parents=True, exist_ok=True)
            self.grade_json.write_text(json.dumps({"hooks": self.table()}, indent=2))
            write(f"per-hook results written to {self.grade_json}")

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session, exitstatus: int) -> None:
        """Grading another implementation, only a course-tier failure fails the run."""
        course = sum(self.counts[h]["course"]["failed"] for h in self.counts)
        if (
            self.external
            and exitstatus == pytest.ExitCode.TESTS_FAILED
            and not course
            and not self.other_failures
        ):
            session.exitstatus = pytest.ExitCode.OK
