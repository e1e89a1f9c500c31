"""One time limit per repository (``--timeout``), and every inner limit a share of it (``grading/limits.py``):
the shares, their floors, bad input, and the record carried from the command line to the judge's workers,
the load check, the course's tests and the leaderboard's plan, and written to ``grade.json``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from cs336_systems.cli import grade as grade_cli
from cs336_systems.grading.class_run.classroom import options_json
from cs336_systems.grading.judge import __main__ as judge_main
from cs336_systems.grading.judge import judging, session
from cs336_systems.grading.limits import DEFAULT_S, SHARES, Limits
from cs336_systems.grading.repo import repo_job
from cs336_systems.grading.repo.leaderboard.clock import ClockPlan
from cs336_systems.grading.roots import discover

from .grading_run import STUDENTS

ADAPTERS = STUDENTS / "src_layout" / "tests" / "adapters.py"


def test_the_default_limit_gives_each_piece_what_it_had() -> None:
    limits = Limits()
    assert limits.repository_s == DEFAULT_S == 1800
    pieces = (
        limits.worker_s,
        limits.load_s,
        limits.course_tests_s,
        limits.leaderboard_wait_s,
        limits.reserve_s,
    )
    assert pieces == pytest.approx((240, 180, 900, 900, 30))
    assert ClockPlan().wait_s == limits.leaderboard_wait_s


def test_each_share_scales_with_the_whole_above_its_floor_and_never_exceeds_it() -> None:
    assert Limits(3600).worker_s == pytest.approx(480) and Limits(3600).course_tests_s == pytest.approx(1800)
    assert Limits(300).worker_s == 120, "the floor: a worker starting torch on a loaded machine"
    for whole in (1.0, 30.0, 120.0, 300.0, 1800.0, 7200.0):
        limits = Limits(whole)
        for piece, rule in SHARES.items():
            got = limits.share(piece)
            assert got <= whole and got == min(whole, max(rule.floor_s, rule.fraction * whole)), (
                piece,
                whole,
            )


@pytest.mark.parametrize("bad", [0.0, -5.0, math.nan])
def test_a_limit_that_is_not_a_positive_number_is_refused(bad: float, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ValueError, match="positive number of seconds"):
        Limits(bad)
    assert grade_cli.main([str(STUDENTS / "src_layout"), "--timeout", str(bad)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--timeout {bad}" in err[0] and "positive" in err[0], err


def test_the_command_lines_timeout_reaches_the_repositorys_job_and_its_judge(tmp_path: Path) -> None:
    args = grade_cli.parse([str(STUDENTS / "src_layout"), "--timeout", "600"])
    options = grade_cli._options(args)
    assert options.limits == Limits(600)
    assert repo_job.options_of(options_json(options)) == options, "options.json: the same record back"
    cmd = repo_job.contract_command(ADAPTERS, options, tmp_path)
    judged = judge_main.config_of(judge_main.parser().parse_args(cmd[3:]))
    assert judged.limits == Limits(600) and judged.limits.worker_s == 120


def test_the_judge_gives_its_workers_and_load_check_their_shares(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, float] = {}

    class Stop(Exception):
        pass

    def grader(*args, **kwargs):
        seen["worker"] = args[3]
        raise Stop

    def run(job):
        seen["load"] = job.timeout
        raise Stop

    monkeypatch.setattr(judging, "Grader", grader)
    monkeypatch.setattr(session, "run", run)
    config = judging.JudgeConfig(adapters=ADAPTERS, limits=Limits(3000))
    prepared = judging.Prepared(discover(ADAPTERS), None, judging.Selection([], 0), 1, True)
    with pytest.raises(Stop):
        judging.judge_selected(config, prepared, None, None)
    with pytest.raises(Stop):
        session.check_loads(discover(ADAPTERS), config.limits)
    assert seen == {"worker": pytest.approx(400), "load": pytest.approx(300)}


def test_the_course_tests_and_the_record_get_the_repositorys_limit(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``repo_job`` hands the course's tests their share, and ``grade.json`` records every limit."""
    from cs336_systems.grading.repo import course_tests

    seen: dict[str, float] = {}

    def tests_run(roots, release, timeout: float) -> dict:
        seen["tests"] = timeout
        return {}

    monkeypatch.setattr(course_tests, "run", tests_run)
    monkeypatch.setattr(course_tests, "release_for", lambda roots, given: None)
    monkeypatch.setattr(course_tests, "agreement", lambda *a: {})
    options = repo_job.RepoOptions(
        tiers="course", course_tests="own", judge_args=("-k", "course-pytorch"), limits=Limits(1200)
    )
    assert repo_job.grade_repo(STUDENTS / "src_layout", tmp_path, options) in (0, 1)
    assert seen["tests"] == pytest.approx(600)
    report = json.loads((tmp_path / "grade.json").read_text())
    assert report["limits"] == Limits(1200).as_dict() and report["limits"]["worker_s"] == 160


def test_the_leaderboard_plan_waits_its_share(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The leaderboard worker's warm-up and rounds wait the repository's share for them, not a constant."""
    import torch

    from cs336_systems.grading.repo.leaderboard import row

    seen: dict[str, float] = {}

    def fake_row(roots, report, plan, **kwargs) -> dict:
        seen["wait"], seen["budget"] = plan.wait_s, kwargs["budget_s"]
        return {"ranked": False}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(row, "row", fake_row)
    roots = discover(STUDENTS / "triton_tile64" / "tests" / "adapters.py")
    got = repo_job._leaderboard_or_why_not(roots, roots.adapters, {}, tmp_path, 500.0, Limits(400))
    assert got == {"ranked": False} and seen == {"wait": 200, "budget": 500.0}
