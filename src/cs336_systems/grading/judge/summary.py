"""The grader's report: one row per hook group (a hook and the hooks it is graded with, e.g. ``get_ddp``
with ``ddp_on_after_backward``), one column per tier, each case counted once; the failures with their
messages; the JSON of ``--grade-json``; the progress lines; and the exit status.

Each graded case is one entry (``case_entry``), collected by a ``Recorder`` in the judging process
(``judging.py``) or, through pytest's ``user_properties``, in the pytest plugin's; the kinds of skips and
errors are structured fields, never searched for in message text.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

from ..probe import ALL_HOOKS
from ..progress import append
from ..shared.cases import (
    GRADED_TIERS,
    NEEDS_GPU,
    NOT_IMPLEMENTED,
    REFUSES_CPU,
    TIERS,
    UNFINISHED_HERE,
    Case,
)
from ..verdict import ERROR, FAILED, PASSED, SKIPPED, Verdict

STATUSES = (PASSED, FAILED, SKIPPED, ERROR)
SKIP_WORDS = {
    NOT_IMPLEMENTED: "not implemented",
    NEEDS_GPU: "needs a GPU: skipped here",
    REFUSES_CPU: "refuses CPU tensors: skipped here",
    UNFINISHED_HERE: "could not grade here (machine overloaded or a connection lost): not scored",
}


def group_verdict(cases: list[dict]) -> str:
    """One word for a hook group: FAIL on a failure in a graded tier (the course's); ``cannot grade`` on
    an error of the grading; else whether the graded tier passed, or why it was skipped, and the other
    tiers that fail."""
    errors = [c for c in cases if c["status"] == ERROR]
    if errors:
        first = errors[0]["message"].splitlines()[0][:160]
        return first if first.startswith("cannot grade") else f"cannot grade: {first}"
    graded = [c for c in cases if c["tier"] in GRADED_TIERS]
    if any(c["status"] == FAILED for c in graded):
        return "FAIL"
    others = [t for t in TIERS if t not in GRADED_TIERS]
    failing = [t for t in others if any(c["status"] == FAILED and c["tier"] == t for c in cases)]
    if any(c["status"] == PASSED for c in graded) or not graded:
        head = "ok" if not failing else f"{' and '.join(GRADED_TIERS)} ok"
    else:
        kinds = Counter(c["kind"] for c in graded)
        head = SKIP_WORDS.get(kinds.most_common(1)[0][0], "skipped") if kinds else "skipped"
    return head + (f"; fails {', '.join(failing)}" if failing else "")


def build(cases: list[dict], seed: int | None, adapters: str | None) -> dict[str, Any]:
    groups: dict[str, dict] = {}
    for case in cases:
        g = groups.setdefault(case["hooks"][0], {"hooks": case["hooks"], "cases": []})
        g["cases"].append(case)
    table = {}
    for name, g in sorted(
        groups.items(), key=lambda kv: ALL_HOOKS.index(kv[0]) if kv[0] in ALL_HOOKS else 99
    ):
        table[name] = {
            "hooks": list(g["hooks"]),
            "verdict": group_verdict(g["cases"]),
            **{t: dict(Counter(c["status"] for c in g["cases"] if c["tier"] == t)) for t in TIERS},
            "failures": [
                {"case": c["id"], "tier": c["tier"], "message": c["message"]}
                for c in g["cases"]
                if c["status"] in (FAILED, ERROR)
            ],
        }
    hooks = {h: {"group": name, **row} for name, row in table.items() for h in row["hooks"]}
    return {
        "adapters": adapters,
        "seed": seed,
        "groups": table,
        "hooks": hooks,
        "cases": cases,
        "totals": dict(Counter(c["status"] for c in cases)),
    }


def exit_status(report: dict, external: bool, status: int) -> int:
    """Grading another implementation: 1 when a course case failed or a case could not be graded here
    (an error of the grading, or a machine too busy to finish it: the grade is incomplete), else 0 (a
    case this machine cannot run as written, for want of a GPU, is neither). Grading the suite's own
    hooks, the run's own status (any failure) stands."""
    if not external:
        return status
    return 1 if any(_fails_the_run(c) for c in report["cases"]) else 0


def _fails_the_run(case: dict) -> bool:
    if case["status"] == FAILED:
        return case["tier"] in GRADED_TIERS
    return case["status"] == ERROR or (case["status"] == SKIPPED and case.get("kind") == UNFINISHED_HERE)


def _cell(counts: dict) -> str:
    if not counts:
        return "-"
    return "/".join(str(counts.get(s, 0)) for s in (PASSED, FAILED, SKIPPED)) + (
        f" +{counts[ERROR]}err" if counts.get(ERROR) else ""
    )


def render(report: dict) -> list[str]:
    """The hook group x tier table (passed/failed/skipped), and a totals line that adds up."""
    rows = [("hook group", *TIERS, "verdict")]
    for name, row in report["groups"].items():
        # Why a group could not be graded is listed above the table, once (not again in each row).
        verdict = "cannot grade (why: above)" if row["verdict"].startswith("cannot grade") else row["verdict"]
        rows.append((name, *(_cell(row[t]) for t in TIERS), verdict))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1] for r in rows]
    totals = report["totals"]
    lines.append(
        f"{len(report['cases'])} cases: "
        + ", ".join(f"{totals.get(s, 0)} {s}" for s in STATUSES)
        + f" (cells: passed/failed/skipped; seed {report['seed']})"
    )
    together = [
        f"{n} with {', '.join(r['hooks'][1:])}" for n, r in report["groups"].items() if len(r["hooks"]) > 1
    ]
    if together:  # a group's hooks are graded together: one is not graded without the others
        lines.insert(len(rows), "graded together: " + "; ".join(together))
    return lines


def case_entry(case: Case, verdict: Verdict, seconds: dict[str, float | None]) -> dict[str, Any]:
    """One graded case as the report and the progress lines read it."""
    return {
        "id": case.id,
        "tier": case.tier,
        "hooks": list(case.hooks),
        "status": verdict.status,
        "kind": verdict.kind,
        "message": verdict.message,
        **seconds,
    }


class Recorder:
    """Each graded case's entry, a progress line for each as it comes (``progress``), and at the end the
    report, written after every process the graded code left is killed (when this process is their
    subreaper: ``isolation`` set)."""

    def __init__(self, seed: int | None, adapters: str | None, progress: Path | None = None) -> None:
        self.seed, self.adapters, self.progress = seed, adapters, progress
        self.cases: dict[str, dict] = {}
        self.started = time.monotonic()

    def add(self, case: dict) -> None:
        self.cases[case["id"]] = case
        if self.progress is None:
            return
        line = {"case": case["id"], "hook": case["hooks"][0], "tier": case["tier"], "status": case["status"]}
        line["elapsed_s"] = round(time.monotonic() - self.started, 1)
        line |= {k: case[k] for k in ("worker_s", "began_s") if k in case}
        append(self.progress, line)  # beside the jobs' phase lines, written from their threads

    def report(self) -> dict:
        return build(list(self.cases.values()), self.seed, self.adapters)

    def write(self, grade_json: Path | None, isolation: dict | None) -> None:
        if isolation is not None:
            from ..sandbox import kill_descendants

            kill_descendants()
        if self.cases and grade_json:
            grade_json.parent.mkdir(parents=True, exist_ok=True)
            report = self.report() | ({"isolation": isolation} if isolation else {})
            grade_json.write_text(json.dumps(report, indent=2))
