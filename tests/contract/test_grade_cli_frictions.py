"""The grading CLI as a new user ran it on real repositories (issue 73), one command each: the worker user
that cannot read the grading environment stops the run in one line; a changed selection regrades; the
exit status follows the rule of ``cli/grade.py``'s help, case by case; an import found nowhere is the
student's failure, said once, with no worker started; one repository keeps its results somewhere named
and ends with its table; a score says which cases it leaves out; no rendezvous warning in the marks."""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

import pytest
import torch

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(400), pytest.mark.usefixtures("suite_self_check")]
COURSE_PYTORCH = ["--", "-k", "course-pytorch"]


def _cli(*args: str, python: str = sys.executable) -> subprocess.CompletedProcess:
    cmd = [python, "-m", "cs336_systems.cli.grade", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)


def _said(run: subprocess.CompletedProcess) -> str:
    return run.stdout[-3000:] + run.stderr[-3000:]


# ---- 1. a worker user that cannot read the grading environment -------------------------------------


def _locked_interpreter(base: Path) -> str:
    """A grading environment only its owner can read, as tox makes ``.tox/``: a virtualenv in a folder of
    mode 700 (in ``base``, which every user can enter) whose packages are this environment's."""
    locked = base / "locked"
    locked.mkdir(mode=0o700)
    venv = locked / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    found = list((venv / "lib").glob("python3*/site-packages"))
    here = sysconfig.get_paths()["purelib"]
    (found[0] / "grading_env.pth").write_text(f"import site; site.addsitedir({here!r})\n")
    return str(venv / "bin" / "python")


def test_a_worker_user_that_cannot_read_the_grading_environment_stops_the_run(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("the graded code runs as another user only when grading as root")
    try:
        pwd.getpwnam("nobody")
    except KeyError:
        pytest.skip("no user 'nobody' on this machine")
    base = Path(tempfile.mkdtemp(prefix="cs336-locked-env-"))  # pytest's tmp folders are root's alone
    base.chmod(0o755)
    try:
        run = _cli(
            str(STUDENTS / "src_layout"), "--out", str(tmp_path / "out"), "--worker-user", "nobody",
            "--tiers", "course", *COURSE_PYTORCH, python=_locked_interpreter(base),
        )  # fmt: skip
    finally:
        shutil.rmtree(base, ignore_errors=True)
    assert run.returncode == 2, _said(run)
    assert run.stderr.strip().count("\n") == 0, "one line"
    assert "cannot grade: the worker user nobody cannot read" in run.stderr, run.stderr
    assert f"{base / 'locked'} (drwx------, owner root) stops it" in run.stderr, run.stderr
    assert "started" not in run.stdout and not (tmp_path / "out").exists(), "nothing ran"


# ---- 2. a changed selection regrades -----------------------------------------------------------------


def test_results_of_another_selection_are_graded_again(tmp_path: Path) -> None:
    repo, out = shutil.copytree(STUDENTS / "src_layout", tmp_path / "src_layout"), tmp_path / "out"
    pick = ["--", "-k", "course-pytorch or b2-q16-k16-d16-full-fp32-cpu"]
    first = _cli(str(repo), "--out", str(out), "--tiers", "course", *pick)
    assert first.returncode == 0 and first.stdout.strip().splitlines()[-1].startswith("1 cases"), _said(first)
    again = _cli(str(repo), "--out", str(out), *pick)  # every tier: one more case
    assert "up to date" not in again.stdout and "[src_layout] started" in again.stdout, _said(again)
    assert again.stdout.strip().splitlines()[-1].startswith("2 cases: 2 passed"), _said(again)
    same = _cli(str(repo), "--out", str(out), *pick)
    assert "[src_layout] up to date" in same.stdout, _said(same)
    assert same.stdout.strip().splitlines()[-1].startswith("2 cases: 2 passed"), "its own table, last"
    phases = [ln for ln in (out / "src_layout" / "progress.jsonl").read_text().splitlines() if "phase" in ln]
    assert phases and '"start"' in phases[0] and '"end"' in phases[-1], phases  # what ran, said as it ran


# ---- 4. the exit status, case by case -----------------------------------------------------------------


def _lazy_missing_dependency(tmp_path: Path) -> Path:
    """A repository whose PyTorch hook imports, when called, a dependency it declares and the grading
    environment lacks (as the course's template imports lazily): each case could not be graded."""
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "lazy_dep")
    adapters = repo / "tests" / "adapters.py"
    adapters.write_text(
        adapters.read_text().replace(
            "def get_flashattention_autograd_function_pytorch() -> type:\n",
            "def get_flashattention_autograd_function_pytorch() -> type:\n    import cs336_dep_not_here  # noqa\n",
        )
    )
    pyproject = repo / "pyproject.toml"
    pyproject.write_text(
        pyproject.read_text().replace('["cs336-basics"]', '["cs336-basics", "cs336-dep-not-here"]')
    )
    return repo


def _missing_import(tmp_path: Path) -> Path:
    """A repository whose adapters file imports, at module level, a module no one has."""
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "missing_import")
    adapters = repo / "tests" / "adapters.py"
    adapters.write_text(
        adapters.read_text().replace("import torch\n", "import torch\nimport nonexistent_module_xyz\n")
    )
    return repo


# The other exits of the rule are asserted beside what their runs print: 0 the course tier passed
# (test_one_repository_with_out_...), 1 a case that could not be graded (test_a_missing_dependency_...) and
# an import found nowhere (test_an_import_found_nowhere_...); one grading each, not two.
EXITS = {
    "a course case fails": (lambda tmp: STUDENTS / "crashes", ["--tiers", "course", *COURSE_PYTORCH], 1),
    "the whole repository timed out": (
        lambda tmp: STUDENTS / "hangs",
        ["--tiers", "course", "--timeout", "3", *COURSE_PYTORCH],
        2,
    ),
    "bad input": (lambda tmp: STUDENTS / "src_layout", ["--tiers", "nonsense"], 2),
}


@pytest.mark.parametrize("case", list(EXITS))
def test_the_exit_status_follows_the_rule_the_help_gives(tmp_path: Path, case: str) -> None:
    """0: the course tier passed; 1: a course case failed or a case could not be graded; 2: the
    repository could not be graded at all. (A busy machine's case: ``test_grade_frictions.py``.)"""
    make, args, expected = EXITS[case]
    run = _cli(str(make(tmp_path)), "--out", str(tmp_path / "out"), *args)
    assert run.returncode == expected, _said(run)


def test_a_missing_dependency_is_named_once(tmp_path: Path) -> None:
    run = _cli(str(_lazy_missing_dependency(tmp_path)), "--out", str(tmp_path / "out"), "--", "-k", "pytorch")
    said = run.stdout + run.stderr
    assert run.returncode == 1, said[-3000:]  # a case that could not be graded
    assert said.count("cannot grade: needs cs336_dep_not_here") == 1, said[-3000:]


# ---- 5. an import found nowhere: the student's failure, found before any worker ------------------------


def test_an_import_found_nowhere_fails_every_case_once_and_at_once(tmp_path: Path) -> None:
    run = _cli(str(_missing_import(tmp_path)), "--out", str(tmp_path / "out"))
    said = run.stdout + run.stderr
    where = tmp_path / "missing_import" / "tests" / "adapters.py"
    line = f"adapters import failed: no module named 'nonexistent_module_xyz' (imported at {where}:4)"
    assert run.returncode == 1 and said.count(line) == 1, said[-3000:]
    assert "((" not in said and "))" not in said and "install it into" not in said, said[-3000:]
    progress = (tmp_path / "out" / "missing_import" / "progress.jsonl").read_text()
    assert '"phase"' not in progress and '"failed"' in progress, "every case failed, and no job started"
    assert ": 0 passed" in run.stdout.strip().splitlines()[-1], run.stdout[-1500:]


# ---- 7. one repository keeps its results where it says, and ends with its table ----------------------


def test_one_repository_without_out_keeps_its_results_and_says_where(tmp_path: Path) -> None:
    name = f"friction-default-out-{os.getpid()}"
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / name)
    kept = ROOT / "runs" / "grades" / name
    try:
        run = _cli(str(repo), "--tiers", "course", *COURSE_PYTORCH)
        assert run.returncode == 0, _said(run)
        assert f"results: {kept}/" in run.stdout and (kept / "results.json").is_file(), run.stdout[-2000:]
        assert run.stdout.strip().splitlines()[-1].startswith("1 cases: 1 passed"), run.stdout[-1000:]
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def test_one_repository_with_out_ends_with_its_table_not_the_class_table(tmp_path: Path) -> None:
    run = _cli(str(STUDENTS / "src_layout"), "--out", str(tmp_path), "--tiers", "course", *COURSE_PYTORCH)
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0 and lines[-1].startswith("1 cases: 1 passed"), run.stdout[-2000:]
    assert any(ln.startswith("hook group") for ln in lines[-4:]), lines[-4:]
    assert (tmp_path / "class.md").is_file() and f"class report: {tmp_path / 'class.md'}" in run.stdout


# ---- 8. a score that leaves cases out says so --------------------------------------------------------


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel runs: nothing is left out")
def test_a_score_says_which_cases_were_not_run_here(tmp_path: Path) -> None:
    run = _cli(str(STUDENTS / "gpu_only"), "--out", str(tmp_path), "--tiers", "course")
    score = next((ln for ln in run.stdout.splitlines() if ln.startswith("score: ")), "")
    assert run.returncode == 0 and "cases not run here" in score, _said(run)
    assert "cases not run here" in (tmp_path / "class.md").read_text()


# ---- 9. no rendezvous warning among the marks ---------------------------------------------------------


def test_a_multi_rank_job_prints_no_rendezvous_warning(tmp_path: Path) -> None:
    run = _cli(
        str(STUDENTS / "shadow"), "--out", str(tmp_path), "--", "-k", "sharded-course-ws2-course-toy",
    )  # fmt: skip
    assert run.returncode == 1, _said(run)  # its planted bug fails the course case
    assert "[c10d]" not in run.stdout + run.stderr, run.stdout[-2000:]
    assert "deselected" in run.stdout, "-k deselected the others"
