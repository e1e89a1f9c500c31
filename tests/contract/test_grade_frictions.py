"""What a new user hit grading real repositories (issue 73, items 1-9), each checked where it was fixed,
without a grading run (``test_grade_cli_frictions.py`` runs the CLI): the worker user's access checked
first; results of another selection not reused; the course's tests shown beside the grader; the exit
status of a case that could not be graded; an import that is nowhere found from the source; progress
lines that say what runs; a score that says what it leaves out; and the noise."""

from __future__ import annotations

import csv
import html
import json
import os
import pwd
import shutil
import sys
import time
from pathlib import Path

import pytest

from cs336_systems.grading import access, gradescope, progress
from cs336_systems.grading.class_run import class_report, course_report
from cs336_systems.grading.class_run.classroom import prepare_repo, up_to_date
from cs336_systems.grading.judge import imports, runner
from cs336_systems.grading.judge.judging import JudgeConfig, Judged, _failures, select
from cs336_systems.grading.judge.session import load_verdict
from cs336_systems.grading.judge.summary import Recorder, build, exit_status, render
from cs336_systems.grading.limits import Limits
from cs336_systems.grading.probe import probe
from cs336_systems.grading.repo.repo_job import RepoOptions
from cs336_systems.grading.roots import discover
from cs336_systems.grading.shared.cases import (
    ATTENTION_HOOKS,
    BEYOND,
    CASES,
    COURSE,
    REFUSES_CPU,
    UNFINISHED_HERE,
)
from cs336_systems.grading.verdict import ERROR, MISSING_DEPENDENCY

from .grading_run import STUDENTS

pytestmark = pytest.mark.usefixtures("suite_self_check")
TRITON, PYTORCH = ATTENTION_HOOKS["triton"], ATTENTION_HOOKS["pytorch"]


# ---- 1. the worker user must be able to read the grading environment and the submission ----------


def _worker_user() -> str:
    if os.geteuid() != 0:
        pytest.skip(
            "runs the check as another user: needs root (a worker user applies to a root grader only)"
        )
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    return "nobody"


def _open_folder(name: str, mode: int) -> Path:
    """A folder every user can reach (pytest's own tmp folders are the owner's alone), then ``name``."""
    base = Path(f"/tmp/cs336-access-{os.getpid()}-{time.monotonic_ns()}")
    base.mkdir(mode=0o755)
    base.chmod(0o755)
    folder = base / name
    folder.mkdir()
    folder.chmod(mode)
    (folder / "adapters.py").write_text("x = 1\n")
    (folder / "adapters.py").chmod(0o644)
    return folder


def test_a_place_the_worker_user_cannot_read_is_named_with_what_stops_it(monkeypatch) -> None:
    user = _worker_user()
    locked, open_ = _open_folder("locked", 0o700), _open_folder("open", 0o755)
    try:
        monkeypatch.setattr(access, "places", lambda _: [(str(open_ / "adapters.py"), os.R_OK)])
        assert access.worker_cannot_read(user, []) is None
        monkeypatch.setattr(access, "places", lambda _: [(str(locked / "adapters.py"), os.R_OK)])
        why = access.worker_cannot_read(user, [])
        assert why is not None and f"cannot read {locked / 'adapters.py'}" in why, why
        assert f"{locked} (drwx------, owner root) stops it" in why, why
    finally:
        shutil.rmtree(locked.parent, ignore_errors=True)
        shutil.rmtree(open_.parent, ignore_errors=True)


def test_an_unknown_worker_user_is_named() -> None:
    assert access.worker_cannot_read("cs336-no-such-user", []) == (
        "--worker-user cs336-no-such-user: no such user on this machine"
    )


def test_what_a_worker_reads_includes_the_interpreter_its_packages_and_every_submission_file() -> None:
    found = dict(access.places([STUDENTS / "src_layout"]))
    assert found[sys.executable] == os.X_OK
    assert any(p.endswith("/torch") for p in found), "the grading environment's torch"
    assert str(STUDENTS / "src_layout" / "src" / "cs336_systems" / "flash.py") in found


# ---- 2. results of another selection are graded again --------------------------------------------


@pytest.mark.parametrize(
    "change",
    [
        {"tiers": None},
        {"judge_args": ("-k", "ddp")},
        {"bench": True},
        {"points": "points.json"},
        {"course_tests": "own"},
        {"seed": 7},
    ],
    ids=["tiers", "-k", "bench", "points", "course tests", "seed"],
)
def test_results_of_another_selection_are_not_up_to_date(tmp_path: Path, change: dict) -> None:
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    (tmp_path / "points.json").write_text("{}")
    if change.get("points"):
        change = {"points": tmp_path / "points.json"}
    graded = RepoOptions(tiers="course", judge_args=("-k", "course-pytorch"))
    out, _ = prepare_repo(tmp_path / "out", "repo", graded)
    time.sleep(0.05)
    (out / "results.json").write_text("{}")
    assert up_to_date(repo, out, graded), "the same selection, results newer than the code"
    assert up_to_date(repo, out, RepoOptions(**{**vars(graded), "workers": 4, "limits": Limits(9.0)}))
    assert not up_to_date(repo, out, RepoOptions(**{**vars(graded), **change}))


def test_results_older_than_the_points_table_are_not_up_to_date(tmp_path: Path) -> None:
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    points = tmp_path / "points.json"
    points.write_text("{}")
    options = RepoOptions(points=points)
    out, _ = prepare_repo(tmp_path / "out", "repo", options)
    time.sleep(0.05)
    (out / "results.json").write_text("{}")
    assert up_to_date(repo, out, options)
    time.sleep(0.05)
    points.write_text('{"course": {"default": 1}}')
    assert not up_to_date(repo, out, options)


@pytest.mark.parametrize("where", ["env/lib/python3.11/site-packages", ".venv/lib", "pkg"])
def test_a_change_in_an_environment_inside_the_repository_leaves_its_results_up_to_date(
    tmp_path: Path, where: str
) -> None:
    """An environment in the repository's folder is libraries, not its code: freshness, the worker user's
    access and the names of its kernels all skip the same folders (``roots.SKIP_DIRS``)."""
    from cs336_systems.grading.judge.kernel_names import SKIP_DIRS as kernel_skips
    from cs336_systems.grading.roots import SKIP_DIRS
    from cs336_systems.grading.shared.repository import ENVIRONMENT_DIRS

    assert kernel_skips is SKIP_DIRS and ENVIRONMENT_DIRS <= SKIP_DIRS
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    options = RepoOptions()
    out, _ = prepare_repo(tmp_path / "out", "repo", options)
    time.sleep(0.05)
    (out / "results.json").write_text("{}")
    time.sleep(0.05)
    (repo / where).mkdir(parents=True)
    (repo / where / "changed.py").write_text("x = 1\n")
    assert up_to_date(repo, out, options) == (where != "pkg"), where


# ---- 3. the course's tests beside the grader, in the class report and the console ----------------


def _graded(out: Path, name: str, report: dict, results: dict | None = None) -> None:
    folder = out / name
    folder.mkdir(parents=True)
    (folder / "grade.json").write_text(json.dumps(report))
    (folder / "results.json").write_text(json.dumps(results or {"score": 5, "tests": [{"max_score": 5.0}]}))


def test_the_course_tests_agreement_is_in_every_form_of_the_class_report(tmp_path: Path) -> None:
    groups = {PYTORCH: {"verdict": "ok"}, "get_fsdp": {"verdict": "FAIL"}}
    said = {PYTORCH: "agree (pass)", "get_fsdp": "DISAGREE: course tests pass, grader fail"}
    _graded(tmp_path, "a", {"groups": groups, "cases": [], "course_tests": {}, "agreement": said})
    _graded(
        tmp_path, "b", {"groups": groups, "cases": [], "course_tests": {}, "course_tests_error": "no release"}
    )
    _graded(tmp_path, "c", {"groups": groups, "cases": []})
    _, printed = class_report.write(tmp_path, ["a", "b", "c"])
    md = (tmp_path / "class.md").read_text()
    for text in (md, printed, html.unescape((tmp_path / "class.html").read_text())):
        assert course_report.COURSE_TITLE in text, text
        assert "DISAGREE: course tests pass, grader fail" in text and "not run: no release" in text
    assert "| a | agree (pass) | DISAGREE: course tests pass, grader fail |" in md, md
    assert "| c |" not in md.split(course_report.COURSE_TITLE)[1], "no row for a repository without them"
    sheet = list(csv.reader((tmp_path / "class.csv").read_text().splitlines()))
    assert sheet[0][-1] == "course tests", sheet[0]
    assert sheet[1][-1] == "1 of 2 groups agree; get_fsdp: DISAGREE: course tests pass, grader fail", sheet


def test_one_repository_says_a_line_per_hook_group_of_the_course_tests() -> None:
    report = {"course_tests": {}, "agreement": {PYTORCH: "agree (pass)", "get_ddp": "agree (fail)"}}
    assert course_report.course_test_lines(report) == [
        f"course tests, {PYTORCH}: agree (pass)",
        "course tests, get_ddp: agree (fail)",
    ]
    assert course_report.course_test_lines({"course_tests": {}, "course_tests_error": "x"}) == [
        "course tests: not run: x"
    ]
    assert course_report.course_test_lines({}) == []


# ---- 4. the exit status: a case the machine could not finish is an incomplete grade ---------------


def _entry(case_id: str, status: str, kind: str = "") -> dict:
    case = CASES[case_id]
    return {"id": case_id, "tier": case.tier, "hooks": list(case.hooks), "status": status, "kind": kind}


def test_a_case_a_busy_machine_could_not_finish_fails_the_run_and_a_gpu_skip_does_not() -> None:
    course = next(c for c in CASES.values() if c.tier == COURSE and c.hooks == (PYTORCH,)).id
    beyond = next(c for c in CASES.values() if c.tier == BEYOND and c.hooks == (PYTORCH,)).id
    gpu = next(c for c in CASES.values() if c.tier == COURSE and c.hooks == (TRITON,)).id
    passed = [_entry(course, "passed")]
    status = lambda cases: exit_status({"cases": cases}, True, 0)
    assert status(passed) == 0
    assert status([*passed, _entry(gpu, "skipped", REFUSES_CPU)]) == 0, "what this machine cannot run"
    assert status([*passed, _entry(beyond, "failed")]) == 0, "only the course tier fails the run"
    assert status([*passed, _entry(beyond, "skipped", UNFINISHED_HERE)]) == 1, "a busy machine's"
    assert status([*passed, _entry(beyond, "error", MISSING_DEPENDENCY)]) == 1
    assert status([_entry(course, "failed")]) == 1


# ---- 5. an import that is nowhere, found from the source before any worker --------------------------


def _student(tmp_path: Path, adapters: str, modules: dict[str, str] | None = None, deps: str = "") -> Path:
    repo = tmp_path / "repo"
    (repo / "tests").mkdir(parents=True)
    (repo / "tests" / "adapters.py").write_text(adapters)
    (repo / "pyproject.toml").write_text(f'[project]\nname = "cs336-systems"\nversion = "26.1.1"\n{deps}')
    for name, text in (modules or {}).items():
        (repo / name).parent.mkdir(parents=True, exist_ok=True)
        (repo / name).write_text(text)
    return repo / "tests" / "adapters.py"


PACKAGE = {"cs336_systems/__init__.py": "", "cs336_systems/flash.py": "import torch\n\nclass F: ...\n"}


@pytest.mark.parametrize(
    "adapters, modules, module, line",
    [
        (
            "import torch\nimport nonexistent_module_xyz\n",
            {},
            "nonexistent_module_xyz",
            "tests/adapters.py:2",
        ),
        (
            "from cs336_systems.flash import F\n",
            {**PACKAGE, "cs336_systems/flash.py": "import os\n\nfrom .helpers import h\n"},
            "cs336_systems.helpers",
            "cs336_systems/flash.py:3",
        ),
        (
            "from cs336_systems import flash\n",
            {**PACKAGE, "cs336_systems/__init__.py": "import cs336_missing_helper\n"},
            "cs336_missing_helper",
            "cs336_systems/__init__.py:1",
        ),
        ("from cs336_systems.flsh import F\n", PACKAGE, "cs336_systems.flsh", "tests/adapters.py:1"),
        ("import cs336_systems.flash\n", {}, "cs336_systems", "tests/adapters.py:1"),
    ],
    ids=["in the adapters", "in a module it reaches", "in a package's init", "a typo", "no package"],
)
def test_an_import_found_nowhere_is_the_students_error(tmp_path, adapters, modules, module, line) -> None:
    roots = discover(_student(tmp_path, adapters, modules))
    missing = imports.missing_import(roots)
    assert missing is not None and missing.module == module and missing.kind == imports.NOWHERE, missing
    assert missing.where == str(tmp_path / "repo" / line), missing
    verdict = load_verdict(roots)
    assert verdict.status == "failed" and verdict.message == (
        f"adapters import failed: no module named {module!r} (imported at {tmp_path / 'repo' / line})"
    )


@pytest.mark.parametrize(
    "adapters",
    [
        "def get_flashattention_autograd_function_pytorch():\n    import nonexistent_module_xyz\n",
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import nonexistent_module_xyz\n",
        "try:\n    import nonexistent_module_xyz\nexcept ImportError:\n    pass\n",
        "if __name__ == '__main__':\n    import nonexistent_module_xyz\n",
        "from __future__ import annotations\nimport torch, os.path\nfrom cs336_systems import flash\n",
    ],
    ids=["in a function", "if TYPE_CHECKING", "try/except", "under __main__", "all there"],
)
def test_imports_that_may_never_run_or_are_there_are_left_to_the_worker(tmp_path, adapters) -> None:
    assert imports.missing_import(discover(_student(tmp_path, adapters, PACKAGE))) is None


def test_a_folder_named_like_a_package_of_the_environment_does_not_hide_it(tmp_path: Path) -> None:
    """A namespace folder (no ``__init__.py``) loses to a regular package anywhere on the path."""
    modules = {**PACKAGE, "torch/notes.txt": "", "cs336_systems/flash.py": "import torch.nn\n"}
    roots = discover(_student(tmp_path, "from cs336_systems.flash import F\n", modules))
    assert imports.missing_import(roots) is None


def test_a_declared_dependency_the_environment_lacks_is_the_graders(tmp_path: Path) -> None:
    deps = 'dependencies = ["torch", "cs336-declared-dep>=1"]\n'
    roots = discover(_student(tmp_path, "import cs336_declared_dep\n", {}, deps))
    missing = imports.missing_import(roots)
    assert missing is not None and missing.kind == imports.DECLARED, missing
    verdict = load_verdict(roots)
    assert verdict.status == ERROR and verdict.kind == MISSING_DEPENDENCY, verdict
    assert verdict.message.startswith("cannot grade: needs cs336_declared_dep (imported at ")
    assert verdict.message.count("(") == verdict.message.count(")") == 1, "no doubled parentheses"


def test_the_suites_fixtures_import_what_they_have() -> None:
    for adapters in sorted(STUDENTS.glob("*/tests/adapters*.py")):
        assert imports.missing_import(discover(adapters)) is None, adapters


# ---- 6. progress lines say what runs now ----------------------------------------------------------


def test_the_progress_line_says_which_job_runs_and_that_it_runs_once_more(tmp_path: Path) -> None:
    path = tmp_path / "progress.jsonl"
    assert progress.progress_line(path) == progress.STARTING
    ids = [c.id for c in CASES.values() if c.family == "ddp" and c.tier == COURSE][:2]
    words = progress.job_words(ids, 2)
    progress.phase(path, progress.START, "job a", words)
    assert progress.progress_line(path).startswith(f"now: {words} for "), progress.progress_line(path)
    recorder = Recorder(1, None, path)
    recorder.add({**_entry(ids[0], "passed"), "message": ""})
    progress.phase(path, progress.START, "job a", f"{words}, once more: timed out at load 9.0 on 2 cores")
    line = progress.progress_line(path)
    assert line.startswith(f"1 cases done, last {CASES[ids[0]].hooks[0]} course (passed); now: ")
    assert "once more: timed out at load 9.0" in line, line
    progress.phase(path, progress.END, "job a", "")
    progress.phase(path, progress.START, "course-tests", "the course's tests")
    assert progress.progress_line(path).endswith("now: the course's tests for 0 s")
    assert [c["case"] for c in progress.case_lines(path)] == [ids[0]], "case lines as other readers read them"
    assert progress.partial_report(path)["cases"][0]["id"] == ids[0]


def test_a_job_that_runs_once_more_is_said(monkeypatch) -> None:
    """``CaseRuns`` tells the judge each job's start, its rerun on a busy machine (and why), its end."""
    said: list[str] = []
    timed_out = runner.Collected(job_problem="timed out after 1 s", timed_out=True)
    monkeypatch.setattr(runner, "run", lambda job: timed_out)
    busy = runner.Machine(load=lambda: 9.0, cores=2)
    runs = runner.CaseRuns(
        discover(STUDENTS / "src_layout" / "tests" / "adapters.py"),
        1.0,
        machine=busy,
        on_job=lambda batch, ws, note: said.append(note),
    )
    case = next(c for c in CASES.values() if c.hooks == (PYTORCH,) and c.tier == COURSE)
    outcome = runs.outcome(case.id, [case.id], 1, lambda c: {})
    assert outcome.unfinished and said == [
        runner.JOB_STARTS,
        "once more: timed out after 1 s at load 9.0 on 2 cores",
        runner.JOB_ENDED,
    ], said


# ---- 8. a score that says what it leaves out ------------------------------------------------------


def test_a_score_says_how_many_cases_it_leaves_out() -> None:
    triton = [c.id for c in CASES.values() if c.tier == COURSE and c.hooks == (TRITON,)]
    pytorch = [c.id for c in CASES.values() if c.tier == COURSE and c.hooks == (PYTORCH,)]
    beyond = [c.id for c in CASES.values() if c.tier == BEYOND and c.hooks == (TRITON,)][:3]
    cases = [
        *[{**_entry(i, "skipped", REFUSES_CPU), "message": ""} for i in triton],
        *[{**_entry(i, "passed"), "message": ""} for i in pytorch],
        *[{**_entry(i, "skipped", REFUSES_CPU), "message": ""} for i in beyond],  # 0 points: not counted
    ]
    doc = gradescope.results({"cases": cases, "seed": 1}, gradescope.DEFAULT_POINTS)
    assert doc["extra_data"]["unscored"] == {"not run here": len(triton)}, doc["extra_data"]
    assert gradescope.problems(doc) == []
    assert class_report.score_text(doc) == f"5 / 5, {len(triton)} cases not run here"
    complete = gradescope.results({"cases": cases[len(triton) :], "seed": 1}, gradescope.DEFAULT_POINTS)
    assert "unscored" not in complete["extra_data"] and class_report.score_text(complete) == "5 / 5"


def test_the_class_report_says_it_in_the_score_cell(tmp_path: Path) -> None:
    results = {"score": 25, "tests": [{"max_score": 25.0}], "extra_data": {"unscored": {"not run here": 2}}}
    _graded(tmp_path, "enzo", {"groups": {TRITON: {"verdict": "refuses CPU tensors: skipped here"}}}, results)
    _, printed = class_report.write(tmp_path, ["enzo"])
    md = (tmp_path / "class.md").read_text()
    assert "| enzo | 25 / 25, 2 cases not run here |" in md and "`not run here`" in md, md
    assert (
        "25 / 25, 2 cases not run here" in printed
        and "25 / 25, 2 cases not run here" in (tmp_path / "class.html").read_text()
    )
    sheet = list(csv.reader((tmp_path / "class.csv").read_text().splitlines()))
    assert sheet[0][-1] == "not in the score" and sheet[1][-1] == "2 not run here", sheet


# ---- 9. noise -------------------------------------------------------------------------------------


def test_without_k_nothing_is_deselected_that_the_file_could_have() -> None:
    adapters = STUDENTS / "src_layout" / "tests" / "adapters.py"  # 2026 edition: no 1.0.5 hooks
    found = probe(adapters)
    assert select(JudgeConfig(), found, requested=True).deselected == 0
    some = select(JudgeConfig(keyword="course-pytorch"), found, requested=True)
    assert len(some.cases) == 1 and some.deselected > 0


def test_cases_that_share_one_message_are_listed_once() -> None:
    recorder = Recorder(1, None)
    message = "cannot grade: needs einx (install it with `pip install einx`)"
    ids = [c.id for c in CASES.values() if c.hooks == (PYTORCH,)][:6]
    for case_id in ids:
        recorder.add({**_entry(case_id, "error", MISSING_DEPENDENCY), "message": message})
    lines = _failures(Judged(recorder))
    assert lines == [f"ERROR {ids[0]} and 5 more cases: {message}"], lines


def test_the_table_names_its_groups_without_unexplained_marks() -> None:
    cases = [_entry(c.id, "passed") for c in CASES.values() if c.family == "ddp" and c.tier == COURSE]
    cases = [{**c, "message": ""} for c in cases]
    lines = render(build(cases, 1, None))
    assert not any("(+" in line for line in lines), lines
    together = [ln for ln in lines if ln.startswith("graded together:")]
    assert together and "get_ddp with ddp_on_after_backward" in together[0], lines


def test_the_legend_explains_only_the_marks_the_table_has(tmp_path: Path) -> None:
    _graded(tmp_path, "a", {"groups": {PYTORCH: {"verdict": "ok"}}, "cases": []})
    _, printed = class_report.write(tmp_path, ["a"])
    md = (tmp_path / "class.md").read_text()
    assert "`-`" not in md and "`—`" not in md and "`-`" not in printed, md
    assert "Score: the points earned" in md
