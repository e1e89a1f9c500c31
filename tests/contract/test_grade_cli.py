"""The grading CLI as a user meets it: the hook x tier table is the last thing printed and its counts add
up; ``--bench`` on a CPU is one line, not a second run; a repository without an adapters file, or a root
that does not exist, is one line naming what is missing, exit 2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("suite_self_check")]


def _cli(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", *args]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=280)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="on a GPU --bench times the row instead")
def test_the_table_is_last_and_adds_up() -> None:
    run = _cli(str(STUDENTS / "triton_tile64"), "--tiers", "course", "--bench", "--", "-k", "pytorch or full")
    lines = run.stdout.strip().splitlines()
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    assert lines[-1].startswith("2 cases: 1 passed, 0 failed, 1 skipped, 0 error"), lines[-3:]
    table = lines[lines.index(next(ln for ln in lines if ln.startswith("hook (graded with)"))) : -1]
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
