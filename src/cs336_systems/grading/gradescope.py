"""A repository's grade as Gradescope's autograder ``results.json`` (``tests[]`` of ``name``, ``score``,
``max_score``, ``status``, ``output``, ``visibility``, ``tags``), from the grader's report.

Points come from a small table (``DEFAULT_POINTS``): a hook group's points for a tier are split evenly
over the group's cases in that tier. The defaults give the course tier the points, as the course's own
tests do; ``beyond`` and ``leaderboard`` cases are reported at 0 points (visible, for the student). A TA
overrides any of it with a JSON file of the same shape (``--points FILE``):
``{"course": {"get_fsdp": 12}, "beyond": {"default": 1}}``.

A case skipped because this machine cannot run it (``needs-gpu``, ``refuses-cpu``) or could not finish
it (``could-not-grade-here``: overloaded, a lost connection) is listed at 0 of 0
points: the environment's limit, not the student's. "Not implemented" scores 0 of its points. When the
grading itself failed (the repository did not load, a dependency is missing, the run crashed or timed
out), a visible "grader failed" entry says so, and ``results.json`` is written all the same.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .verdict import ERROR, PASSED, SKIPPED
from .worker.cases import NEEDS_GPU, REFUSES_CPU, TIERS, UNFINISHED_HERE

DEFAULT_POINTS: dict[str, dict[str, float]] = {
    "course": {
        "get_flashattention_autograd_function_pytorch": 5,
        "get_flashattention_autograd_function_triton": 10,
        "get_ddp_individual_parameters": 5,
        "get_ddp_bucketed": 5,
        "get_ddp": 5,
        "get_sharded_optimizer": 5,
        "get_fsdp": 10,
        "default": 0,
    },
    "leaderboard": {"default": 0},
    "beyond": {"default": 0},
}
ENVIRONMENT = (NEEDS_GPU, REFUSES_CPU, UNFINISHED_HERE)


def load_points(path: Path | None) -> dict[str, dict[str, float]]:
    """The default table with a TA's overrides (a JSON file of the same shape) merged in."""
    points = {tier: dict(row) for tier, row in DEFAULT_POINTS.items()}
    if path is not None:
        for tier, row in json.loads(path.read_text()).items():
            if tier not in TIERS or not isinstance(row, dict):
                raise ValueError(
                    f"{path}: points are given per tier ({', '.join(TIERS)}), each a table of hook -> points"
                )
            points[tier].update({k: float(v) for k, v in row.items()})
    return points


def _case_points(cases: list[dict], points: dict[str, dict[str, float]]) -> dict[str, float]:
    """Each case's share of its hook group's points in its tier."""
    counted: dict[tuple[str, str], list[dict]] = {}
    for c in cases:
        if c["kind"] not in ENVIRONMENT:
            counted.setdefault((c["hooks"][0], c["tier"]), []).append(c)
    share = {}
    for (group, tier), members in counted.items():
        row = points.get(tier, {})
        total = float(row.get(group, row.get("default", 0)))
        share |= {c["id"]: total / len(members) for c in members}
    return share


def results(
    report: dict[str, Any] | None, points: dict[str, dict[str, float]], failure: str | None = None
) -> dict[str, Any]:
    """Gradescope's results for one repository; ``failure`` (or a report without cases) adds a visible
    "grader failed" entry."""
    tests = []
    cases = (report or {}).get("cases", [])
    share = _case_points(cases, points)
    for c in cases:
        max_score = round(share.get(c["id"], 0.0), 4)
        passed = c["status"] == PASSED
        output = c["message"] or ("passed" if passed else c["status"])
        if c["status"] == SKIPPED:
            output = f"skipped ({c['kind']}): {c['message']}"
        tests.append(
            {
                "name": f"{c['hooks'][0]}: {c['id']}",
                "score": max_score if passed else 0.0,
                "max_score": max_score,
                "status": "passed" if passed else "failed",
                "output": output[:8000],
                "visibility": "visible",
                "tags": [c["tier"], c["hooks"][0]],
            }
        )
    errors = [c for c in cases if c["status"] == ERROR]
    if failure or not cases or errors:
        why = failure or (errors[0]["message"] if errors else "the grader produced no verdicts")
        tests.append(
            {
                "name": "grader failed",
                "score": 0.0,
                "max_score": 0.0,
                "status": "failed",
                "output": why[:8000],
                "visibility": "visible",
                "tags": ["grader"],
            }
        )
    return {
        "score": round(sum(t["score"] for t in tests), 2),
        "output": f"seed {(report or {}).get('seed')}; {len(cases)} cases graded",
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "tests": tests,
    }


REQUIRED = {
    "name": str,
    "score": (int, float),
    "max_score": (int, float),
    "status": str,
    "output": str,
    "visibility": str,
}


def problems(doc: dict[str, Any]) -> list[str]:
    """What keeps ``doc`` from being a valid results.json (empty when it is valid)."""
    found = [] if isinstance(doc.get("tests"), list) else ["no tests list"]
    for i, test in enumerate(doc.get("tests") or []):
        for key, kind in REQUIRED.items():
            if not isinstance(test.get(key), kind):
                found.append(f"tests[{i}].{key} missing or not {kind}")
        if test.get("status") not in ("passed", "failed"):
            found.append(f"tests[{i}].status is {test.get('status')!r}")
        if test.get("visibility") not in ("visible", "hidden", "after_due_date", "after_published"):
            found.append(f"tests[{i}].visibility is {test.get('visibility')!r}")
        if (
            isinstance(test.get("score"), int | float)
            and isinstance(test.get("max_score"), int | float)
            and test["score"] > test["max_score"]
        ):
            found.append(f"tests[{i}] scores above its max_score")
    return found
