"""``results.json``, exactly: a group's points split over its cases and adding up to the group's points,
each tier its own points, "not implemented" worth 0 of its points, a case this machine cannot run or
the grading could not decide (a missing dependency) neither passed nor failed, a syntax error the
student's failing tests, "grader failed" visible, and every document checked before it is written."""

from __future__ import annotations

import json
from decimal import Decimal
from pathlib import Path

import pytest

from cs336_systems.grading import gradescope
from cs336_systems.grading.repo import repo_job
from cs336_systems.grading.shared.cases import CASES, COURSE

POINTS = gradescope.DEFAULT_POINTS
COURSE_POINTS = {"get_fsdp": 10, "get_ddp": 5, "get_flashattention_autograd_function_pytorch": 5}


def _case(n: int, hook: str, tier: str = "course", status: str = "passed", kind: str = "") -> dict:
    return {
        "id": f"{hook}-{tier}-{n}",
        "tier": tier,
        "hooks": [hook],
        "status": status,
        "kind": kind,
        "message": "m",
    }


def _scores(doc: dict) -> list[tuple[float, float]]:
    return [(t["score"], t["max_score"]) for t in doc["tests"]]


def _exact_sum(values: list[float]) -> Decimal:
    """The sum a reader of the JSON sees: each number as written, added in decimal."""
    return sum((Decimal(repr(v)) for v in values), Decimal(0))


def test_a_groups_points_are_split_over_its_cases() -> None:
    cases = [_case(i, "get_fsdp", status="failed" if i == 3 else "passed") for i in range(4)]
    doc = gradescope.results({"cases": cases, "seed": 1}, POINTS)
    assert _scores(doc) == [(2.5, 2.5), (2.5, 2.5), (2.5, 2.5), (0.0, 2.5)]
    assert doc["score"] == 7.5 and [t["status"] for t in doc["tests"]] == ["passed"] * 3 + ["failed"]
    assert gradescope.problems(doc) == []


def test_shares_add_up_to_the_groups_points_exactly() -> None:
    """5 points over 3 cases are 1.67 + 1.67 + 1.66; the score is the tests' scores added, in hundredths."""
    doc = gradescope.results({"cases": [_case(i, "get_ddp") for i in range(3)]}, POINTS)
    assert _scores(doc) == [(1.67, 1.67), (1.67, 1.67), (1.66, 1.66)]
    assert _exact_sum([t["max_score"] for t in doc["tests"]]) == 5
    assert Decimal(repr(doc["score"])) == _exact_sum([t["score"] for t in doc["tests"]]) == 5


def test_every_course_case_passing_scores_every_course_point() -> None:
    """The whole case table, as a class run on a GPU host grades it: shares of groups of 2 to 30 cases."""
    cases = [
        {"id": c.id, "tier": c.tier, "hooks": list(c.hooks), "status": "passed", "kind": "", "message": ""}
        for c in CASES.values()
    ]
    doc = gradescope.results({"cases": cases}, POINTS)
    course = {c.hooks[0] for c in CASES.values() if c.tier == COURSE}
    total = sum(POINTS["course"].get(g, 0) for g in course)
    assert total == 45 and Decimal(repr(doc["score"])) == total
    assert (
        _exact_sum([t["score"] for t in doc["tests"]])
        == total
        == _exact_sum([t["max_score"] for t in doc["tests"]])
    )


def test_each_tier_has_its_own_points(tmp_path: Path) -> None:
    cases = [_case(0, "get_ddp"), *(_case(i, "get_ddp", "beyond") for i in range(3))]
    assert _scores(gradescope.results({"cases": cases}, POINTS)) == [(5.0, 5.0)] + [(0.0, 0.0)] * 3
    table = tmp_path / "points.json"
    table.write_text(json.dumps({"beyond": {"default": 1}}))
    doc = gradescope.results({"cases": cases}, gradescope.load_points(table))
    assert _scores(doc) == [(5.0, 5.0), (0.34, 0.34), (0.33, 0.33), (0.33, 0.33)] and doc["score"] == 6
    table.write_text(json.dumps({"course": {"get_ddp": -1}}))
    with pytest.raises(ValueError, match="points are numbers of 0 or more"):
        gradescope.load_points(table)


def test_not_implemented_scores_zero_of_its_points() -> None:
    blank = _case(0, "get_fsdp", status="skipped", kind="not-implemented")
    doc = gradescope.results({"cases": [blank]}, POINTS)
    assert _scores(doc) == [(0.0, 10.0)] and doc["tests"][0]["status"] == "failed"
    assert doc["score"] == 0


def test_a_case_this_machine_cannot_run_is_neither_passed_nor_failed() -> None:
    """On a CPU the GPU cases skip: 0 of 0 points and no status (Gradescope knows only passed and
    failed); the group's points go to the cases that ran."""
    cases = [_case(0, "get_ddp"), _case(1, "get_ddp", status="skipped", kind="needs-gpu")]
    cases.append(_case(2, "get_ddp", status="skipped", kind="refuses-cpu"))
    doc = gradescope.results({"cases": cases}, POINTS)
    assert _scores(doc) == [(5.0, 5.0), (0.0, 0.0), (0.0, 0.0)] and doc["score"] == 5
    skipped = doc["tests"][1:]
    assert all("status" not in t and t["output"].startswith("not graded on this machine") for t in skipped)
    assert gradescope.problems(doc) == []


def test_grader_failed_is_visible_and_worth_nothing() -> None:
    for doc in (gradescope.results(None, POINTS, "timed out after 45 s"), gradescope.results({}, POINTS)):
        failed = [t for t in doc["tests"] if t["name"] == "grader failed"]
        assert len(failed) == 1 and failed[0]["visibility"] == "visible", doc
        assert failed[0]["status"] == "failed" and (failed[0]["score"], failed[0]["max_score"]) == (0, 0)
        assert doc["visibility"] == "visible" and gradescope.problems(doc) == []


def test_a_missing_dependency_is_could_not_grade_never_the_students_failure() -> None:
    """FSDP cases whose code imports einx, missing from the grading environment: each is listed at 0 of
    0, visible, with no status, and the document says what to add; the passing cases keep their shares
    (2.5 each), and the ungraded cases' shares go to no one."""
    cases = [_case(i, "get_fsdp", status="error", kind="missing-dependency") for i in range(2)]
    cases += [_case(i, "get_fsdp") for i in range(2, 4)]
    doc = gradescope.results({"cases": cases}, POINTS)
    assert _scores(doc) == [(0.0, 0.0), (0.0, 0.0), (2.5, 2.5), (2.5, 2.5)] and doc["score"] == 5
    ungraded = doc["tests"][:2]
    assert all("status" not in t and t["visibility"] == "visible" for t in ungraded), ungraded
    assert all(
        t["output"].startswith("could not grade (missing-dependency), not your failure") for t in ungraded
    )
    assert "grader failed" not in [t["name"] for t in doc["tests"]]
    assert "--student-deps" in doc["output"] and gradescope.problems(doc) == []


def test_a_syntax_error_is_the_students_failing_tests(tmp_path: Path) -> None:
    """Through the repository job: the file is parsed before any worker starts, and its error is the
    student's failing tests, not "grader failed"."""
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    adapters = tmp_path / "repo" / "tests" / "adapters.py"
    adapters.write_text("def get_ddp(:\n")
    out = tmp_path / "out"
    assert repo_job.grade_repo(adapters, out, repo_job.RepoOptions()) == 2
    doc = json.loads((out / "results.json").read_text())
    assert "grader failed" not in [t["name"] for t in doc["tests"]]
    assert all(t["status"] == "failed" and "does not parse" in t["output"] for t in doc["tests"]), doc
    assert doc["score"] == 0 and _exact_sum([t["max_score"] for t in doc["tests"]]) == 45
    assert gradescope.problems(doc) == []
    assert not (out / "contract.log").exists()  # no worker, no judge started


def test_an_invalid_document_is_never_written(tmp_path: Path) -> None:
    good = gradescope.results({"cases": [_case(0, "get_ddp")]}, POINTS)
    assert gradescope.write(tmp_path / "good.json", good) == []
    assert json.loads((tmp_path / "good.json").read_text()) == good
    bad = {**good, "tests": [{**good["tests"][0], "status": "skipped"}]}
    found = gradescope.write(tmp_path / "bad.json", bad)
    assert found == ["tests[0].status is 'skipped'"]
    written = json.loads((tmp_path / "bad.json").read_text())
    assert gradescope.problems(written) == [] and [t["name"] for t in written["tests"]] == ["grader failed"]
    assert "tests[0].status is 'skipped'" in written["tests"][0]["output"]


def test_problems_are_named() -> None:
    test = {
        "name": "x",
        "score": 2,
        "max_score": 1,
        "status": "skipped",
        "output": "",
        "visibility": "visible",
    }
    found = gradescope.problems({"score": 4, "tests": [test, {**test, "status": None} | {"score": 1}]})
    assert "tests[0].status is 'skipped'" in found, found
    assert "tests[0] scores 2, above its max_score 1" in found, found
    assert any("not the sum of the tests' scores" in p for p in found), found
    unscored = {k: v for k, v in test.items() if k != "status"} | {"score": 0}
    assert gradescope.problems({"score": 0, "tests": [unscored]}) == [
        "tests[0] has no status but carries points"
    ]


def test_only_a_ranked_row_reaches_gradescopes_leaderboard() -> None:
    points = gradescope.load_points(None)
    ranked = {"cases": [], "seed": 1, "seconds": {"contract": 40.2, "bench": 61.0}}
    ranked["leaderboard"] = {"ranked": True, "parent_ms": 9.12345, "course_ms": 1.0}
    doc = gradescope.results(ranked, points)
    assert doc["leaderboard"] == [{"name": gradescope.LEADERBOARD_NAME, "value": 9.123, "order": "asc"}]
    assert doc["execution_time"] == 101
    earlier = {**ranked, "leaderboard": {"ranked": True, "mean_ms": 9.12345}}  # a row of the earlier name
    assert gradescope.results(earlier, points)["leaderboard"] == doc["leaderboard"]
    for unranked in ({"ranked": False, "parent_ms": 2.0}, {"ranked": True, "parent_ms": float("nan")}):
        assert "leaderboard" not in gradescope.results({**ranked, "leaderboard": unranked}, points)
    bad = {**doc, "leaderboard": [{"name": "x", "value": float("inf"), "order": "asc"}]}
    assert any("leaderboard[0]" in p for p in gradescope.problems(bad))


INVALID = {  # what a bug of the grader's could build: a status Gradescope refuses, a score above its max
    "score": 2,
    "tests": [
        {"name": "x", "score": 2, "max_score": 1, "status": "skipped", "output": "", "visibility": "visible"}
    ],
}
# The grade.json a judge writes for one passed case (a stand-in for the contract run).
JUDGE = """
import json, sys
case = {"id": "c", "tier": "course", "hooks": ["get_ddp"], "status": "passed", "kind": "", "message": ""}
open(sys.argv[1], "w").write(json.dumps({"cases": [case], "groups": {}, "seed": 1}))
"""


def _grade_a_repository(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The repository job's own path: its judge wrote grade.json, and results.json follows from it."""
    import sys

    from .grading_run import STUDENTS

    def judge(adapters: Path, opts, out: Path) -> list[str]:
        return [sys.executable, "-c", JUDGE, str(out / "grade.json")]

    monkeypatch.setattr(repo_job, "contract_command", judge)
    monkeypatch.setattr(repo_job, "walls_here", lambda out: {})
    repo_job.grade_repo(STUDENTS / "src_layout", tmp_path / "graded", repo_job.RepoOptions())
    assert not (tmp_path / "graded" / "failure.txt").exists(), "graded, not a failure to grade"
    return tmp_path / "graded" / "results.json"


def _does_not_parse(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "repo" / "tests").mkdir(parents=True)
    (tmp_path / "repo" / "tests" / "adapters.py").write_text("def get_ddp(:\n")
    repo_job.grade_repo(tmp_path / "repo", tmp_path / "syntax", repo_job.RepoOptions())
    return tmp_path / "syntax" / "results.json"


def _not_there(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    repo_job.grade_repo(tmp_path / "absent", tmp_path / "absent-out", repo_job.RepoOptions())
    return tmp_path / "absent-out" / "results.json"


def _unfinished(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from cs336_systems.grading.class_run import classroom

    classroom.record_failure(tmp_path, "timed out after 1 s", None)
    return tmp_path / "results.json"


def _distrusted(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from cs336_systems.grading.class_run import classroom

    classroom.distrust(tmp_path, "could not be trusted: wrote x", None)
    return tmp_path / "results.json"


@pytest.mark.parametrize(
    "write", [_grade_a_repository, _does_not_parse, _not_there, _unfinished, _distrusted]
)
def test_every_results_json_is_checked_before_it_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write
) -> None:
    """Whichever way a repository's results.json comes to be written (graded, not gradable, its grading
    unfinished or distrusted), a document that is not valid never reaches the file: "grader failed"
    does, naming what was wrong."""
    monkeypatch.setattr(gradescope, "results", lambda *args, **kw: INVALID)
    monkeypatch.setattr(gradescope, "students_error", lambda *args, **kw: INVALID)
    doc = json.loads(write(tmp_path, monkeypatch).read_text())
    assert gradescope.problems(doc) == [], doc
    assert [t["name"] for t in doc["tests"]] == ["grader failed"], doc
    assert "tests[0].status is 'skipped'" in doc["tests"][0]["output"], doc
