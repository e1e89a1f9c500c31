"""A repository's grade as Gradescope's autograder ``results.json`` (``tests[]`` of ``name``, ``score``,
``max_score``, ``status``, ``output``, ``visibility``, ``tags``), from the grader's report.

Points come from a small table (``DEFAULT_POINTS``): a hook group's points for a tier are split over
the group's cases in that tier, in hundredths, so that the shares add up to the group's points exactly
(10 over 3 cases: 3.34, 3.33, 3.33) and the submission's ``score`` is the sum of its tests' scores. The
defaults give the course tier the points, as the course's own tests do; ``beyond`` and ``leaderboard``
cases are reported at 0 points (visible, for the student). A TA overrides any of it with a JSON file of
the same shape (``--points FILE``): ``{"course": {"get_fsdp": 12}, "beyond": {"default": 1}}``.

A case skipped because this machine cannot run it (``needs-gpu``, ``refuses-cpu``) or could not
finish it (``could-not-grade-here``: overloaded, a lost connection) is listed at 0 of 0 points with no
``status``: the environment's limit, neither the student's pass nor their failure (Gradescope's status
is only "passed" or "failed"); its share of the group's points goes to the group's other cases. So is
a case the grading itself could not decide (a verdict of status ``error``: a dependency of the
student's code missing from the grading environment, a model the grader cannot grade against, the
grader raising): "could not grade", visible, the document's ``output`` saying what to fix; its share
goes to no one, so that code raising such an error on purpose gains nothing by it. "Not implemented"
fails at 0 of its points. The student's own errors are theirs: an adapters file that does not parse
fails every hook group that carries points (``students_error``). When the grading as a whole failed
(the run crashed or timed out, or produced no verdicts) or the judging raised, a visible "grader
failed" entry says so, and
``results.json`` is written all the same. ``write`` validates every document (``problems``) before it
reaches the file.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

from .leaderboard_row import LeaderboardRow
from .shared.cases import (
    ATTENTION_HOOKS,
    BEYOND,
    COURSE,
    LEADERBOARD,
    NEEDS_GPU,
    REFUSES_CPU,
    TIERS,
    TRITON_HOOK,
    UNFINISHED_HERE,
    hook_groups,
)
from .verdict import ERROR, GRADER_RAISED, MISSING_DEPENDENCY, PASSED, SKIPPED

DEFAULT_POINTS: dict[str, dict[str, float]] = {
    COURSE: {
        ATTENTION_HOOKS["pytorch"]: 5,
        TRITON_HOOK: 10,
        "get_ddp_individual_parameters": 5,
        "get_ddp_bucketed": 5,
        "get_ddp": 5,
        "get_sharded_optimizer": 5,
        "get_fsdp": 10,
        "default": 0,
    },
    LEADERBOARD: {"default": 0},
    BEYOND: {"default": 0},
}
ENVIRONMENT = (NEEDS_GPU, REFUSES_CPU, UNFINISHED_HERE)
DEPENDENCY_HINT = "course staff: add it to the autograder with `cli.autograder --student-deps NAME`"
CENTS = 100  # points are counted in hundredths: shares of a group add up to its points exactly
MAX_OUTPUT = 8000


def load_points(path: Path | None) -> dict[str, dict[str, float]]:
    """The default table with a TA's overrides (a JSON file of the same shape) merged in."""
    points = {tier: dict(row) for tier, row in DEFAULT_POINTS.items()}
    if path is not None:
        for tier, row in json.loads(path.read_text()).items():
            if tier not in TIERS or not isinstance(row, dict):
                raise ValueError(
                    f"{path}: points are given per tier ({', '.join(TIERS)}), each a table of hook -> points"
                )
            bad = {k: v for k, v in row.items() if not _number(v) or v < 0}
            if bad:
                raise ValueError(f"{path}: points are numbers of 0 or more, not {bad}")
            points[tier].update({k: float(v) for k, v in row.items()})
    return points


def _group_points(points: dict[str, dict[str, float]], tier: str, group: str) -> int:
    row = points.get(tier, {})
    return round(float(row.get(group, row.get("default", 0))) * CENTS)


def split(total: int, n: int) -> list[int]:
    """``total`` hundredths over ``n`` cases: equal shares, the remainder a hundredth each to the first."""
    base, extra = divmod(total, n)
    return [base + (i < extra) for i in range(n)]


def _environment(case: dict) -> bool:
    """Skipped: this machine cannot run it, or could not finish it."""
    return case["status"] == SKIPPED and case["kind"] in ENVIRONMENT


def _case_cents(cases: list[dict], points: dict[str, dict[str, float]]) -> dict[str, int]:
    """Each case's share of its hook group's points in its tier, in hundredths; an ungraded case (an
    error) takes its share too, which it does not score (``_case_entry``)."""
    counted: dict[tuple[str, str], list[str]] = {}
    for c in cases:
        if not _environment(c):
            counted.setdefault((c["hooks"][0], c["tier"]), []).append(c["id"])
    share: dict[str, int] = {}
    for (group, tier), members in counted.items():
        share |= dict(zip(members, split(_group_points(points, tier, group), len(members)), strict=True))
    return share


def _entry(name: str, cents: int, max_cents: int, status: str | None, output: str, tags: list) -> dict:
    test = {"name": name, "score": cents / CENTS, "max_score": max_cents / CENTS}
    if status is not None:  # no status: neither passed nor failed (a case this machine cannot run)
        test["status"] = status
    return test | {"output": output[:MAX_OUTPUT], "visibility": "visible", "tags": tags}


def _case_entry(c: dict, max_cents: int) -> tuple[dict, int]:
    """The case's test and its score in hundredths; an ungraded or skipped case is 0 of 0."""
    passed = c["status"] == PASSED
    status: str | None = "passed" if passed else "failed"
    output = c["message"] or ("passed" if passed else c["status"])
    if c["status"] == ERROR:
        status, output = None, f"could not grade ({c['kind']}), not your failure, no points: {c['message']}"
        max_cents = 0
    elif _environment(c):
        status, output = None, f"not graded on this machine ({c['kind']}), no points: {c['message']}"
    cents = max_cents if passed else 0
    name = f"{c['hooks'][0]}: {c['id']}"
    return _entry(name, cents, max_cents, status, output, [c["tier"], c["hooks"][0]]), cents


def _grader_failed(why: str) -> dict:
    return _entry("grader failed", 0, 0, "failed", why, ["grader"])


def _document(
    tests: list[dict], score_cents: int, output: str, report: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The submission's document; ``score`` is the sum of the tests' scores, counted in hundredths. A
    ranked leaderboard row becomes Gradescope's ``leaderboard`` entry (an unranked one has none)."""
    report = report or {}
    seconds = [s for s in (report.get("seconds") or {}).values() if _number(s)]
    doc: dict[str, Any] = {
        "score": score_cents / CENTS,
        "execution_time": round(math.fsum(seconds)),
        "output": output,
        "visibility": "visible",
        "stdout_visibility": "hidden",
        "extra_data": {"seed": report.get("seed")},
        "tests": tests,
    }
    row = LeaderboardRow.read(report.get("leaderboard"))
    if row is not None and row.ranked and row.parent_ms is not None:
        doc["leaderboard"] = [{"name": LEADERBOARD_NAME, "value": round(row.parent_ms, 3), "order": "asc"}]
    return doc


LEADERBOARD_NAME = "2025 leaderboard case, ms (the grader's clock)"


def results(
    report: dict[str, Any] | None, points: dict[str, dict[str, float]], failure: str | None = None
) -> dict[str, Any]:
    """Gradescope's results for one repository; ``failure``, a report without cases or a judging that
    raised (a bug of the grader's) adds a visible "grader failed" entry."""
    cases = (report or {}).get("cases", [])
    share = _case_cents(cases, points)
    graded = [_case_entry(c, share.get(c["id"], 0)) for c in cases]
    tests = [t for t, _ in graded]
    bugs = [c["message"] for c in cases if c["status"] == ERROR and c["kind"] == GRADER_RAISED]
    if failure or not cases or bugs:
        tests.append(_grader_failed(failure or (bugs[0] if bugs else "the grader produced no verdicts")))
    doc = _document(tests, sum(c for _, c in graded), _output(report, cases), report)
    if unscored := _unscored(cases, points):
        doc["extra_data"]["unscored"] = unscored
    return doc


NOT_RUN_HERE, NOT_GRADED = "not run here", "could not be graded"  # cases left out of the maximum


def _unscored(cases: list[dict], points: dict[str, dict[str, float]]) -> dict[str, int]:
    """How many cases that would carry points are out of the score: not run on this machine (no GPU, a
    kernel that refuses CPU tensors, a machine too busy), or not decided (an error of the grading), so
    that a complete-looking score says so."""
    counts = {NOT_RUN_HERE: 0, NOT_GRADED: 0}
    for c in cases:
        if _group_points(points, c["tier"], c["hooks"][0]) <= 0:
            continue
        if _environment(c):
            counts[NOT_RUN_HERE] += 1
        elif c["status"] == ERROR:
            counts[NOT_GRADED] += 1
    return {k: n for k, n in counts.items() if n}


def _output(report: dict[str, Any] | None, cases: list[dict]) -> str:
    """The document's summary line; ungraded cases are counted apart, with what would grade them."""
    errors = [c for c in cases if c["status"] == ERROR]
    output = f"seed {(report or {}).get('seed')}; {len(cases) - len(errors)} cases graded"
    if errors:
        output += f"; {len(errors)} could not be graded here (no points either way): {errors[0]['message']}"
        if any(c["kind"] == MISSING_DEPENDENCY for c in errors):
            output += f" ({DEPENDENCY_HINT})"
    return output[:MAX_OUTPUT]


def students_error(why: str, points: dict[str, dict[str, float]]) -> dict[str, Any]:
    """The student's own code stopped the grading before any case ran (the adapters file does not
    parse): every hook group that carries points in a tier fails at 0 of them, saying why."""
    tests = []
    for tier in TIERS:
        for group in hook_groups(tier):
            if cents := _group_points(points, tier, group):
                tests.append(_entry(f"{group}: {tier} tier", 0, cents, "failed", why, [tier, group]))
    return _document(tests, 0, f"not graded: {why}"[:MAX_OUTPUT])


def write(path: Path, doc: dict[str, Any]) -> list[str]:
    """Write ``doc`` to ``path`` when it is a valid results.json; else a visible "grader failed"
    document naming what was wrong (nothing invalid reaches Gradescope). Returns the problems found."""
    found = problems(doc)
    if found:
        why = f"the grader built an invalid results.json: {'; '.join(found[:5])}"
        print(why, file=sys.stderr)
        doc = _document([_grader_failed(why)], 0, why[:MAX_OUTPUT])
    path.write_text(json.dumps(doc, indent=2))
    return found


REQUIRED = {
    "name": str,
    "score": (int, float),
    "max_score": (int, float),
    "output": str,
    "visibility": str,
}
VISIBILITIES = ("visible", "hidden", "after_due_date", "after_published")


def _number(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x)


def _test_problems(i: int, test: Any) -> list[str]:
    if not isinstance(test, dict):
        return [f"tests[{i}] is not an object"]
    found = [
        f"tests[{i}].{k} missing or not {t}" for k, t in REQUIRED.items() if not isinstance(test.get(k), t)
    ]
    if "status" in test and test["status"] not in ("passed", "failed"):
        found.append(f"tests[{i}].status is {test.get('status')!r}")
    if "status" not in test and test.get("max_score") != 0:
        found.append(f"tests[{i}] has no status but carries points")
    if test.get("visibility") not in VISIBILITIES:
        found.append(f"tests[{i}].visibility is {test.get('visibility')!r}")
    score, top = test.get("score"), test.get("max_score")
    if _number(score) and _number(top) and score > top:
        found.append(f"tests[{i}] scores {score}, above its max_score {top}")
    if _number(score) and score < 0:
        found.append(f"tests[{i}] scores {score}, below 0")
    return found


def problems(doc: dict[str, Any]) -> list[str]:
    """What keeps ``doc`` from being a valid results.json (empty when it is valid)."""
    tests = doc.get("tests")
    if not isinstance(tests, list):
        return ["no tests list"]
    found = [p for i, t in enumerate(tests) for p in _test_problems(i, t)]
    scores = [t.get("score") for t in tests if isinstance(t, dict)]
    if not _number(doc.get("score")):
        found.append("no score")
    elif all(_number(s) for s in scores) and not math.isclose(doc["score"], math.fsum(scores), abs_tol=1e-9):
        found.append(f"score {doc['score']} is not the sum of the tests' scores {math.fsum(scores)}")
    if doc.get("visibility", "visible") not in VISIBILITIES:
        found.append(f"visibility is {doc.get('visibility')!r}")
    for i, entry in enumerate(doc.get("leaderboard", [])):
        ok = isinstance(entry, dict) and isinstance(entry.get("name"), str) and _number(entry.get("value"))
        if not ok or entry.get("order", "desc") not in ("asc", "desc"):
            found.append(f"leaderboard[{i}] is not a name, a finite value and an order")
    return found
