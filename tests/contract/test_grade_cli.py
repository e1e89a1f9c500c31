"""The grading CLI as a user meets it: the hook x tier table is the last thing printed and its counts add
up; ``--bench`` on a CPU is one line, not a second run; a repository without an adapters file, or a root
that does not exist, is one line naming what is missing, exit 2; bad input (unknown tiers, an output path
that cannot be written, a target that does not exist, an empty folder, an adapters file that does not
parse) is one line before torch or any worker starts; one repository keeps its time limit."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("suite_self_check")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=280)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU --bench times the row instead")
def test_the_table_is_last_and_adds_up(tmp_path: Path) -> None:
    run = _cli(
        str(STUDENTS / "triton_tile64"), "--out", str(tmp_path), "--tiers", "course", "--bench",
        "--", "-k", "pytorch or full",
    )  # fmt: skip
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines[-1].startswith("2 cases: 1 passed, 0 failed, 1 skipped, 0 error"), lines[-3:]
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("hook group"))) : -1]
    cells = [c for row in table[1:] for c in row.split()[1:4] if "/" in c]
    assert sum(sum(map(int, c.split("/"))) for c in cells) == 2, table
    assert "needs a CUDA GPU (none here): not timed" in run.stdout
    sessions = [
        ln for ln in lines if " in " in ln and ("passed" in ln or "skipped" in ln) and "deselected" in ln
    ]
    assert len(sessions) == 1, "one pytest session, not a second one for the bench"


def test_a_folder_without_adapters_is_one_line(tmp_path: Path) -> None:
    run = _cli(str(tmp_path))
    assert run.returncode == 2 and "has no tests/adapters.py" in run.stderr, run.stderr
    assert "--adapters" not in run.stderr and len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_a_root_that_does_not_exist_is_one_line() -> None:
    run = _cli(str(STUDENTS / "src_layout"), "--repo-root", "/nope")
    assert run.returncode == 2 and "--repo-root /nope: no such folder" in run.stderr, run.stderr
    assert "INTERNALERROR" not in run.stdout + run.stderr and len(run.stderr.strip().splitlines()) == 1


# Runs the CLI in a process that says afterwards whether torch was imported: bad input stops first.
_PROBE = (
    "import runpy, sys\n"
    "sys.argv = ['grade', *sys.argv[1:]]\n"
    "try:\n"
    "    runpy.run_module('cs336_systems.cli.grade', run_name='__main__')\n"
    "except SystemExit as exc:\n"
    "    print('torch imported' if 'torch' in sys.modules else 'no torch')\n"
    "    raise\n"
)


def _bad_input_cases(tmp: Path) -> dict[str, tuple[list[str], str]]:
    broken = tmp / "broken"
    (broken / "tests").mkdir(parents=True)
    (broken / "tests" / "adapters.py").write_text("x = 1\n\ndef get_ddp(:\n")
    (tmp / "empty").mkdir()
    (tmp / "a_file").write_text("")
    good = str(STUDENTS / "src_layout")
    return {
        "unknown tier": ([good, "--tiers", "nonsense"], "--tiers: unknown tier 'nonsense'"),
        "one unknown tier among known": ([good, "--tiers", "course,bogus"], "unknown tier 'bogus'"),
        "out under /proc": ([good, "--out", "/proc/forbidden"], "--out /proc/forbidden: cannot write"),
        "out under a file": ([good, "--out", str(tmp / "a_file" / "sub")], "is a file"),
        "missing target": ([str(tmp / "nope")], "nope: no such file or folder"),
        "missing target, class form": (
            [str(tmp / "nope"), "--out", str(tmp / "o")],
            "nope: no such file or folder",
        ),
        "empty folder, class form": (
            [str(tmp / "empty"), "--out", str(tmp / "o")],
            "has no tests/adapters.py",
        ),
        "adapters that do not parse": (
            [str(broken)],
            f"{broken / 'tests' / 'adapters.py'}:3: does not parse",
        ),
    }


@pytest.mark.parametrize(
    "case",
    [
        "unknown tier",
        "one unknown tier among known",
        "out under /proc",
        "out under a file",
        "missing target",
        "missing target, class form",
        "empty folder, class form",
        "adapters that do not parse",
    ],
)
def test_bad_input_is_one_line_before_anything_runs(tmp_path: Path, case: str) -> None:
    args, expected = _bad_input_cases(tmp_path)[case]
    cmd = [sys.executable, "-c", _PROBE, *args]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and expected in run.stderr, (run.returncode, run.stderr[-2000:])
    assert len(run.stderr.strip().splitlines()) == 1, run.stderr[-2000:]
    assert run.stdout.strip() == "no torch", "checked before torch (and so any worker) was imported"
    assert not (tmp_path / "o").exists(), "no class folder for a class that has nothing to grade"


def test_one_repository_keeps_its_time_limit(tmp_path: Path) -> None:
    started = time.monotonic()
    run = _cli(
        str(STUDENTS / "hangs"), "--out", str(tmp_path), "--tiers", "course", "--timeout", "3",
        "--", "-k", "course-pytorch",
    )  # fmt: skip
    assert run.returncode == 2 and "timed out after 3 s" in run.stderr, run.stdout[-2000:] + run.stderr
    assert "[hangs] started" in run.stdout, "the class's progress lines, for one repository too"
    assert time.monotonic() - started < 120, "the limit stopped the run"
