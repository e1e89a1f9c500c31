"""The class report as a TA reads it after a run on a machine without a GPU: the cases that need one are
one line per hook group, not a row per ``-cuda`` case id as if they had run; the ``-cuda`` cases that ran
on the CPU under Triton's interpreter say so; every mark of the table is explained under it."""

from __future__ import annotations

import html
import json
from pathlib import Path

import pytest

from cs336_systems.grading.class_run import class_report
from cs336_systems.grading.shared.cases import ATTENTION_HOOKS, CASES, NEEDS_GPU

pytestmark = pytest.mark.usefixtures("suite_self_check")
TRITON, PYTORCH = ATTENTION_HOOKS["triton"], ATTENTION_HOOKS["pytorch"]


def _ids(tier: str, stand_in: bool, n: int) -> list[str]:
    """``n`` Triton case ids of ``tier``: ones the CPU runs under the interpreter, or ones that need a GPU."""
    found = [
        c.id
        for c in CASES.values()
        if c.hooks == (TRITON,) and c.tier == tier and bool(c.knob("interpreter_stand_in")) == stand_in
    ]
    assert len(found) >= n, (tier, stand_in, found)
    return found[:n]


def _case(case_id: str, status: str, kind: str = "") -> dict:
    return {"id": case_id, "tier": CASES[case_id].tier, "hooks": [TRITON], "status": status, "kind": kind}


def _repo(out: Path, name: str, cases: list[dict], groups: dict[str, str]) -> None:
    folder = out / name
    folder.mkdir(parents=True)
    report = {"groups": {g: {"verdict": v} for g, v in groups.items()}, "cases": cases}
    (folder / "grade.json").write_text(json.dumps(report))
    (folder / "results.json").write_text(json.dumps({"score": 10, "tests": [{"max_score": 10.0}]}))


def _cpu_cases() -> list[dict]:
    """A run without a GPU: two course cases interpreted, the big beyond and leaderboard ones skipped."""
    ran = [_case(i, "passed") for i in _ids("course", True, 2)]
    needs = _ids("beyond", False, 3) + _ids("leaderboard", False, 2)
    return ran + [_case(i, "skipped", NEEDS_GPU) for i in needs]


def test_cases_a_cpu_could_not_run_are_one_line_per_hook_group_not_rows_of_cuda_ids(tmp_path: Path) -> None:
    _repo(tmp_path, "cpu_a", _cpu_cases(), {TRITON: "ok"})
    _repo(tmp_path, "cpu_b", _cpu_cases(), {TRITON: "ok"})
    on_gpu = [_case(i, "passed") for i in _ids("course", True, 2) + _ids("leaderboard", False, 2)]
    _repo(tmp_path, "gpu_c", on_gpu, {TRITON: "ok"})
    _, printed = class_report.write(tmp_path, ["cpu_a", "cpu_b", "gpu_c"])
    md = (tmp_path / "class.md").read_text()
    for text in (md, printed, html.unescape((tmp_path / "class.html").read_text())):
        assert "not run: needs a CUDA GPU" in text and "Triton's interpreter" in text, text
        assert not any(i in text for i in CASES if i.endswith("-cuda")), "no case id, as if it ran"
    lines = [ln for ln in md.splitlines() if ln.startswith("- ")]
    assert len(lines) == 2, lines  # one per reason and hook group, not one per case or repository
    assert lines[0].startswith("- not run: needs a CUDA GPU") and lines[0].endswith(
        f": {TRITON}: leaderboard 2, beyond 3 (in cpu_a, cpu_b)"
    ), lines
    assert "interpreter" in lines[1] and lines[1].endswith(f": {TRITON}: course 2 (in cpu_a, cpu_b)"), lines
    assert "gpu_c" not in "".join(lines), "where a GPU was, its cases ran as written"


def test_a_class_that_ran_everything_as_written_has_no_such_section(tmp_path: Path) -> None:
    _repo(tmp_path, "gpu", [_case(i, "passed") for i in _ids("leaderboard", False, 2)], {TRITON: "ok"})
    _, printed = class_report.write(tmp_path, ["gpu"])
    assert "not run" not in (tmp_path / "class.md").read_text() + printed
    assert "interpreter" not in (tmp_path / "class.md").read_text() + printed


def test_the_dash_of_a_group_a_repository_was_not_graded_in_is_explained(tmp_path: Path) -> None:
    """``—``: an edition without the hooks, or a selection that took none of the group's cases."""
    _repo(tmp_path, "both", [], {PYTORCH: "ok", TRITON: "ok"})
    _repo(tmp_path, "earlier_run", [], {PYTORCH: "ok"})
    _, printed = class_report.write(tmp_path, ["both", "earlier_run"])
    md = (tmp_path / "class.md").read_text()
    assert "| earlier_run | 10 / 10 | ok | — |" in md, md
    legend = next(ln for ln in md.splitlines() if ln.startswith("`—`"))
    assert "edition" in legend and "`-k`" in legend, legend
    assert "`-`" not in legend, "no repository without a score: that mark is not explained"
    assert legend in printed


def test_adapters_files_of_one_repository_are_told_apart(tmp_path: Path) -> None:
    """A fixture's variants (``tests/adapters_<variant>.py`` of one repository) graded as a class get a
    row each, named by their variant; a repository and its ``adapters.py`` keep the repository's name."""
    from cs336_systems.grading.class_run.classroom import repositories

    tests = tmp_path / "fixture" / "tests"
    tests.mkdir(parents=True)
    for name in ("adapters.py", "adapters_wrong.py", "adapters_timer.py"):
        (tests / name).write_text("")
    names = repositories([tests / "adapters.py", tests / "adapters_wrong.py", tests / "adapters_timer.py"])
    assert list(names) == ["fixture", "fixture-wrong", "fixture-timer"]
    assert list(repositories([tmp_path / "fixture"])) == ["fixture"]
