"""A class in one command (``cli.grade`` on several repositories): a repository that hangs, one whose
worker crashes, one whose adapters file does not parse and one that imports what is nowhere are each one
row with that verdict, and the others are graded as if alone; every ``results.json`` is valid
Gradescope; a rerun grades only what changed."""

from __future__ import annotations

import csv
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cs336_systems.grading import gradescope

from .grading_run import ROOT, STUDENTS, clean_env

# One xdist group (tox runs `--dist loadgroup`): the module runs in one worker, which makes its
# fixture's class run once rather than once per worker.
pytestmark = [
    pytest.mark.timeout(400),
    pytest.mark.usefixtures("suite_self_check"),
    pytest.mark.xdist_group("test_class_grading"),
]
PYTORCH_COURSE = "course-pytorch"  # one quick case per repository


def _grade(targets: list[Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", *map(str, targets), "--out", str(out)]
    cmd += ["--jobs", "2", "--tiers", "course", "--timeout", "30", *extra, "--", "-k", PYTORCH_COURSE]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def class_run(
    tmp_path_factory: pytest.TempPathFactory,
) -> tuple[subprocess.CompletedProcess, Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("class")
    broken = root / "repos" / "broken"
    (broken / "tests").mkdir(parents=True)
    (broken / "tests" / "adapters.py").write_text("def get_ddp(:\n")
    unloadable = root / "repos" / "unloadable"  # parses; its import fails in every worker
    (unloadable / "tests").mkdir(parents=True)
    (unloadable / "tests" / "adapters.py").write_text(
        "import cs336_not_installed_anywhere\n\n\ndef get_flashattention_autograd_function_pytorch():\n"
        "    return cs336_not_installed_anywhere.FlashAttention\n"
    )
    repos = {
        "src_layout": STUDENTS / "src_layout",
        "hangs": STUDENTS / "hangs",
        "crashes": STUDENTS / "crashes",
        "broken": broken,
        "unloadable": unloadable,
    }
    copies = {}
    for name, path in repos.items():  # copies: the rerun test touches one
        copies[name] = (
            shutil.copytree(path, root / "repos2" / name) if path.is_relative_to(STUDENTS) else path
        )
    out = root / "out"
    return _grade(list(copies.values()), out), out, copies


def _results(out: Path, name: str) -> dict:
    return json.loads((out / name / "results.json").read_text())


def test_each_failure_is_one_row_and_the_others_are_graded(class_run) -> None:
    run, out, _ = class_run
    assert run.returncode == 1, "a repository whose grading failed fails the class run"
    report = (out / "class.md").read_text()
    assert "timed out after 30 s" in run.stdout and "hangs" in run.stdout, run.stdout[-3000:]
    rows = {
        line.split("|")[1].strip(): line
        for line in report.splitlines()
        if line.startswith("| ") and "---" not in line
    }
    assert "does not parse" in rows["broken"], rows
    broken = (out / "broken" / "failure.txt").read_text()
    assert "adapters.py:1: does not parse" in broken, "file:line, found by parsing the file"
    assert not (out / "broken" / "contract.log").exists(), "no worker started for a file that cannot load"
    # An import found nowhere is the student's error (read from the source): every case fails.
    assert rows["unloadable"].split("|")[2:4] == [" 0 / 5 ", " FAIL "], rows["unloadable"]
    for name in ("broken", "hangs"):  # not graded: no score, rather than a score of 0
        assert rows[name].split("|")[2].strip() == "-", rows[name]
    assert "timed out" in rows["hangs"], rows
    assert "FAIL" in rows["crashes"], rows
    assert rows["src_layout"].count("| ok |") == 1, rows
    crashed = _results(out, "crashes")["tests"]
    assert any("killed by SIGABRT" in t["output"] for t in crashed), crashed
    graded = _results(out, "src_layout")  # one course case, the whole of its group's points
    assert [(t["score"], t["max_score"], t["status"]) for t in graded["tests"]] == [(5.0, 5.0, "passed")]
    assert graded["score"] == 5.0
    lines = [json.loads(line) for line in (out / "src_layout" / "progress.jsonl").read_text().splitlines()]
    progress = [p for p in lines if "case" in p]  # the phase lines say what ran when
    assert progress and all(isinstance(p["worker_s"], float) and p["began_s"] > 0 for p in progress), progress


def test_every_results_json_is_valid_gradescope(class_run) -> None:
    _, out, copies = class_run
    for name in copies:
        doc = _results(out, name)
        assert gradescope.problems(doc) == [], (name, gradescope.problems(doc))
    names = [t["name"] for t in _results(out, "hangs")["tests"]]
    assert "grader failed" in names, names
    unloadable = _results(out, "unloadable")["tests"]
    assert [(t["score"], t["max_score"], t["status"]) for t in unloadable] == [(0.0, 5.0, "failed")]
    assert "no module named 'cs336_not_installed_anywhere'" in unloadable[0]["output"], unloadable
    broken = _results(out, "broken")  # a syntax error is the student's: every group with points fails
    assert "grader failed" not in [t["name"] for t in broken["tests"]], broken
    assert broken["score"] == 0 and all(
        t["status"] == "failed" and t["max_score"] > 0 for t in broken["tests"]
    )
    assert (out / "class.html").read_text().startswith("<!doctype html>")
    assert (out / "class.csv").read_text().splitlines()[0].startswith("repository,score")


def test_a_rerun_grades_only_what_changed(class_run) -> None:
    _, out, copies = class_run
    keep = {n: p for n, p in copies.items() if n in ("src_layout", "broken")}
    before = (out / "src_layout" / "results.json").stat().st_mtime
    time.sleep(1.1)
    os.utime(copies["broken"] / "tests" / "adapters.py")
    again = _grade(list(keep.values()), out)
    assert "[src_layout] up to date" in again.stdout, again.stdout[-2000:]
    assert "[broken] started" in again.stdout, again.stdout[-2000:]
    assert (out / "src_layout" / "results.json").stat().st_mtime == before


def test_results_json_problems_are_named() -> None:
    bad = {
        "tests": [
            {
                "name": "x",
                "score": 2,
                "max_score": 1,
                "status": "skipped",
                "output": "",
                "visibility": "visible",
            }
        ]
    }
    found = gradescope.problems(bad)
    assert any("status" in p for p in found) and any("above its max_score" in p for p in found), found


def _fake_repo(out: Path, name: str, score: float | None, groups: dict | None, failure: str = "") -> None:
    folder = out / name
    folder.mkdir(parents=True)
    if groups is not None:
        (folder / "grade.json").write_text(json.dumps({"groups": groups, "cases": []}))
    tests = [{"name": "a", "max_score": 10.0}, {"name": "b", "max_score": 20.0}] if score is not None else []
    (folder / "results.json").write_text(json.dumps({"score": score, "tests": tests}))
    if failure:
        (folder / "failure.txt").write_text(failure + "\n")


def test_the_class_report_rows_match_their_header(tmp_path: Path) -> None:
    from cs336_systems.grading.class_run import class_report

    long_reason = "cannot grade: " + " ".join(f"word{i}" for i in range(80))
    _fake_repo(tmp_path, "graded", 27.5, {"get_ddp": {"verdict": "ok"}})
    _fake_repo(tmp_path, "other_edition", 5, {"get_ddp_bucketed": {"verdict": "FAIL"}})
    _fake_repo(tmp_path, "failed", None, None, long_reason)
    _, table = class_report.write(tmp_path, ["graded", "other_edition", "failed"])
    md = (tmp_path / "class.md").read_text()
    rows = [ln for ln in md.splitlines() if ln.startswith("| ")]
    assert len({ln.count(" | ") for ln in rows}) == 1, rows  # every row as wide as the header
    assert "| graded | 27.5 / 30 | — | ok |" in md, md
    failed = next(ln for ln in rows if ln.startswith("| failed"))
    cell = failed.split(" | ")[2]
    assert cell.endswith("...") and long_reason.startswith(cell[:-3].rstrip()), "cut at a word"
    assert "`—`" in md and "`-`" in md and "failure.txt" in md, "the marks are explained under the table"
    assert "`—`" in table, "and in what the CLI prints"
    sheet = list(csv.reader((tmp_path / "class.csv").read_text().splitlines()))
    assert sheet[0][:3] == ["repository", "score", "max_score"], sheet[0]
    assert {len(r) for r in sheet} == {len(sheet[0])}, sheet
    assert sheet[1][:3] == ["graded", "27.5", "30"] and long_reason in sheet[3], sheet
    assert "27.5 / 30" in (tmp_path / "class.html").read_text()


def test_a_class_of_failures_alone_still_has_a_column_for_why(tmp_path: Path) -> None:
    from cs336_systems.grading.class_run import class_report

    _fake_repo(tmp_path, "empty", None, None, "cannot grade: no tests/adapters.py")
    class_report.write(tmp_path, ["empty"])
    sheet = list(csv.reader((tmp_path / "class.csv").read_text().splitlines()))
    assert {len(r) for r in sheet} == {len(sheet[0])} and "no tests/adapters.py" in sheet[1][-1], sheet
