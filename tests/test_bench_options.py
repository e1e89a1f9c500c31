"""bench/conftest.py: the guards of a bench run, in real pytest sessions (subprocesses) over a small
synthetic bench file: xdist is refused, ``--only`` names unknown parameters and values, and rows that
were not timed stay out of pytest-benchmark's terminal table but in its JSON. And the thread count:
the same for benches and the CLI, recorded in every row."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems.harness.environment import environment_info

REPO = Path(__file__).parents[1]
BENCH_CONFTEST = REPO / "bench" / "conftest.py"

SYNTHETIC_BENCH = """
import time

import pytest


@pytest.mark.parametrize(("size", "ctx"), [("tiny", 32), ("small", 256), ("small", 64)])
def test_case(benchmark, size, ctx):
    if ctx == 64:
        from cs336_systems.harness.record import record_not_run  # imported here: collection stays light

        record_not_run(benchmark, "unsupported", "no kernel")
        return
    benchmark.pedantic(time.sleep, args=(0.002,), rounds=2, iterations=1)
"""


@pytest.fixture
def bench_dir(tmp_path: Path) -> Path:
    shutil.copy(BENCH_CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "bench_synthetic.py").write_text(SYNTHETIC_BENCH)
    return tmp_path


def run_pytest(directory: Path, *args: str) -> subprocess.CompletedProcess:
    # Not the outer run's xdist worker variables: pytest-benchmark would read them as its own.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--rootdir={directory}"]
    command += ["-o", "python_files=bench_*.py", "bench_synthetic.py", *args]
    return subprocess.run(command, cwd=directory, env=env, capture_output=True, text=True, timeout=120)


def test_bench_run_under_xdist_is_refused(bench_dir: Path) -> None:
    result = run_pytest(bench_dir, "-n", "2", f"--benchmark-json={bench_dir / 'x.json'}")
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert "cannot run under pytest-xdist (-n 2)" in result.stderr and "-n 0" in result.stderr
    assert not (bench_dir / "x.json").exists()
    # Untimed smoke runs under xdist stay possible.
    smoke = run_pytest(bench_dir, "-n", "1", "--benchmark-disable", "-q")
    assert smoke.returncode == 0, smoke.stdout + smoke.stderr
    assert "3 passed" in smoke.stdout


@pytest.mark.parametrize(
    ("only", "message"),
    [
        (["nosuch=1"], "no collected case has a parameter 'nosuch'; parameters: ctx, size"),
        (["Size=tiny"], "no collected case has a parameter 'Size' (did you mean 'size'?)"),
        (["size=huge"], "no collected case has size = huge; size takes small, tiny"),
        (["size=tiny", "ctx=32,9"], "no collected case has ctx = 9; ctx takes 32, 64, 256"),
    ],
)
def test_only_names_unknown_parameters_and_values(bench_dir: Path, only: list[str], message: str) -> None:
    result = run_pytest(bench_dir, "--collect-only", "-q", *(f"--only={o}" for o in only))
    assert result.returncode == pytest.ExitCode.USAGE_ERROR, result.stdout + result.stderr
    assert message in result.stderr


def test_only_keeps_the_matching_cases(bench_dir: Path) -> None:
    result = run_pytest(bench_dir, "--collect-only", "-q", "--only=size=small", "--only=ctx=256,32")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "bench_synthetic.py::test_case[small-256]" in result.stdout
    assert "1/3 tests collected (2 deselected)" in result.stdout


def test_untimed_rows_stay_out_of_the_table_but_in_the_json(bench_dir: Path) -> None:
    out = bench_dir / "out.json"
    result = run_pytest(bench_dir, f"--benchmark-json={out}", "--benchmark-columns=min,mean,rounds")
    assert result.returncode == 0, result.stdout + result.stderr
    table = result.stdout[result.stdout.index("Name (time in") :]
    assert "test_case[tiny-32]" in table and "test_case[small-64]" not in table
    assert table.startswith("Name (time in ms)")  # the no-op row no longer drags the unit down to ns
    assert "1 row(s) not timed (OOM / unsupported / skipped) are left out" in result.stdout
    rows = {b["name"]: b for b in json.loads(out.read_text())["benchmarks"]}
    assert rows["test_case[small-64]"]["extra_info"]["reason"] == "no kernel"
    assert len(rows) == 3


def test_threads_pinned_only_in_xdist_test_workers() -> None:
    """The root conftest pins one torch thread per xdist test worker only: a serial bench run keeps
    torch's default, as the CLI does, so the same case times the same in both."""
    probe = "import torch; n = torch.get_num_threads(); import conftest; print(n, torch.get_num_threads())"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])

    def threads(**extra: str) -> tuple[int, int]:
        out = subprocess.run(
            [sys.executable, "-c", probe],
            cwd=REPO,
            env={**env, **extra},
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        default, after = out.stdout.split()
        return int(default), int(after)

    default, serial = threads()
    assert serial == default
    _, worker = threads(PYTEST_XDIST_WORKER="gw0")
    assert worker == (default if torch.cuda.is_available() else 1)


def test_rows_record_the_thread_count() -> None:
    assert environment_info("cpu")["torch_threads"] == torch.get_num_threads()


def test_only_offers_pass_not_the_python_name(tmp_path: Path) -> None:
    """A parameter named ``pass_`` (Python's keyword dodged) is ``pass`` to --only; both spellings
    select (issue 38: ``--only`` offered the internal-looking ``pass_``)."""
    shutil.copy(BENCH_CONFTEST, tmp_path / "conftest.py")
    (tmp_path / "bench_synthetic.py").write_text(
        "import pytest\n\n\n@pytest.mark.parametrize('pass_', ['fwd', 'bwd'])\n"
        "def test_case(benchmark, pass_):\n    pass\n"
    )
    wrong = run_pytest(tmp_path, "--collect-only", "-q", "--only=pas=fwd")
    assert "parameters: pass" in wrong.stderr and "pass_" not in wrong.stderr
    for spelling in ("pass", "pass_"):
        result = run_pytest(tmp_path, "--collect-only", "-q", f"--only={spelling}=bwd")
        assert result.returncode == 0 and "1/2 tests collected (1 deselected)" in result.stdout, result.stderr
