"""Grading student-like repositories (``tests/data/students/``, see its README) the way a grader does:
each graded in worker processes of its own, with its own ``cs336_systems`` and ``cs336_basics``, never
the suite's; and an adapters file that cannot load stops the run with one line."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from .grading_run import DATA, ROOT, STUDENTS, clean_env, grade

pytestmark = [pytest.mark.timeout(420), pytest.mark.usefixtures("suite_self_check")]


@pytest.mark.parametrize("equals_form", [False, True], ids=["space", "equals"])
def test_student_modules_at_the_suites_paths_are_graded_not_shadowed(equals_form: bool) -> None:
    """The planted bug in the student's ``cs336_systems/distributed/sharded_optimizer.py`` fails the
    hook: the suite's correct optimizer at the same module path would have passed."""
    run = grade(
        STUDENTS / "shadow/tests/adapters.py",
        "-k",
        "course and (sharded or ddp2026)",
        equals_form=equals_form,
    )
    assert run.hooks["get_sharded_optimizer"]["verdict"] == "FAIL", run.output[-3000:]
    assert "rank 1, step 9: max |" in run.failures("get_sharded_optimizer"), run.failures(
        "get_sharded_optimizer"
    )
    assert run.hooks["get_ddp"]["verdict"] == "ok", run.output[-3000:]
    assert run.returncode == 1, "a course failure fails the run"
    assert "tests.conftest" not in run.output


def test_a_raise_planted_in_the_students_module_reaches_the_grader(tmp_path: Path) -> None:
    repo = shutil.copytree(STUDENTS / "shadow", tmp_path / "shadow")
    module = repo / "cs336_systems/distributed/sharded_optimizer.py"
    module.write_text('raise RuntimeError("planted in the student module")\n' + module.read_text())
    run = grade(repo / "tests/adapters.py", "-k", "sharded")
    assert "planted in the student module" in run.output and "Traceback" not in run.output, run.output[-2000:]
    assert run.returncode != 0


def test_src_layout_with_metadata_call_and_own_basics() -> None:
    """``src/cs336_systems`` whose ``__init__`` calls ``importlib.metadata.version`` (nothing installed),
    ``cs336_basics`` found through ``[tool.uv.sources]``: graded, course tier passes, exit 0."""
    run = grade(STUDENTS / "src_layout/tests/adapters.py", "-k", "pytorch and course")
    assert run.hooks["get_flashattention_autograd_function_pytorch"]["verdict"] == "ok", run.output[-3000:]
    assert run.returncode == 0, run.output[-3000:]


def test_blank_2026_template_lists_its_own_hooks_only() -> None:
    """Every hook of the course's blank 2026 template is "not implemented" (read from its source,
    before any worker), and 1.0.5's own hooks are not in the report at all."""
    run = grade(DATA / "blank_adapters_26_1_1.py", "-k", "course")
    assert run.returncode == 0, run.output[-2000:]
    assert set(run.hooks) >= {"get_fsdp", "get_ddp", "get_sharded_optimizer"}
    assert "get_ddp_bucketed" not in run.hooks
    assert all(h["verdict"] == "not implemented" for h in run.hooks.values()), run.hooks
    assert all(c["kind"] == "not-implemented" for c in run.report["cases"])


BROKEN = {
    "missing": (None, "no adapters file"),
    "directory": ("dir", "is a folder, not an adapters file"),
    "syntax": ("def get_ddp(:\n", "does not parse"),
    "dependency": (
        "import jaxtyping_not_installed_here\n",
        "missing dependency 'jaxtyping_not_installed_here'",
    ),
    "student-module": ("from cs336_systems.nowhere import X\n", "no module named 'cs336_systems.nowhere'"),
}


@pytest.mark.parametrize("kind", BROKEN)
def test_broken_adapters_file_is_one_line(tmp_path: Path, kind: str) -> None:
    content, expected = BROKEN[kind]
    path = tmp_path / "repo" / "tests" / "adapters.py"
    path.parent.mkdir(parents=True)
    (tmp_path / "repo" / "cs336_systems").mkdir()
    (tmp_path / "repo" / "cs336_systems" / "__init__.py").write_text("")
    if content == "dir":
        path.mkdir()
    elif content is not None:
        path.write_text(content)
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/contract",
        "--adapters",
        str(path),
        "-p",
        "no:cacheprovider",
        "-n",
        "0",
        "-q",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    out = run.stdout + run.stderr
    assert run.returncode not in (0, 1) and expected in out, out[-2000:]
    assert "Traceback" not in out and len(out.strip().splitlines()) <= 3, out[-2000:]


def test_bench_adapters_rows_time_the_students_code_in_its_own_ranks(tmp_path: Path) -> None:
    """The sharding and DDP benches' adapters rows run the student's hooks in worker ranks and record
    torch's DDP / ZeRO on the same workload beside them."""
    out = tmp_path / "rows.json"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "bench/bench_sharding.py",
        "bench/bench_ddp.py",
        "-k",
        "adapters and ws2",
        "--adapters",
        str(STUDENTS / "shadow/tests/adapters.py"),
        f"--benchmark-json={out}",
        "-p",
        "no:cacheprovider",
        "-q",
        "-n",
        "0",
    ]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rows = {b["name"]: b["extra_info"] for b in json.loads(out.read_text())["benchmarks"]}
    assert rows["test_adapters_sharding_step[adapters-ws2]"]["torch_zero_same_workload_ms"] > 0, rows
    assert rows["test_adapters_ddp_step[adapters-ws2]"]["torch_ddp_same_workload_ms"] > 0, rows
