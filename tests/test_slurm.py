"""The sweep's Slurm path against a real Slurm: the one-node cluster of ``scripts/slurm_local.sh``
(started here when it is not running; skipped, with the reason, where it cannot be: not root, no
packages). Two tiny CPU bench cases go through ``--executor slurm``: the submitted scripts carry the
options given as ``#SBATCH`` lines, a job cancelled while the sweep runs is a failed row, and the rerun
completes it. With a stand-in bench file: a 2-minute job ends by the suite's own limit, a partition the
cluster lacks is one line, and a Ctrl-C cancels the running jobs and keeps the finished one."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cs336_systems.harness.sweep import case_files

from .helpers.standin import alive, interrupt, node_id, start, sweep, wait_until, write_bench
from .helpers.standin import env as standin_env

REPO = Path(__file__).parents[1]
SELECTION = ["bench/bench_model.py", "-k", "test_warmup and tiny and (warmup0 or warmup1)"]
CASES = 2


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def sweep_command(out: Path, parallelism: int = 2) -> list[str]:
    command = [sys.executable, "-m", "cs336_systems.cli.sweep", *SELECTION, "--out", str(out)]
    command += ["--executor", "slurm", "--partition", "debug", "--time-min", "7", "--cpus-per-job", "1"]
    return [*command, "--parallelism", str(parallelism), "--slurm-param", "comment=cs336-sweep-test"]


def run(command: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=480)


def test_sweep_through_slurm(slurm, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    done = run(sweep_command(out))
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    rows = json.loads((out / "sweep.json").read_text())["benchmarks"]
    assert len(rows) == CASES and all(r["extra_info"]["group_key"] == "warmup" for r in rows)
    assert all(re.fullmatch(r"\d+_\d+", r["extra_info"]["job"]["job_id"]) for r in rows)  # array tasks
    scripts = list((out / "jobs").glob("*_submission.sh"))
    assert scripts, "submitit wrote no sbatch script"
    sbatch = {
        line.strip() for s in scripts for line in s.read_text().splitlines() if line.startswith("#SBATCH")
    }
    for expected in ("--partition=debug", "--time=7", "--cpus-per-task=1", "--comment=cs336-sweep-test"):
        assert f"#SBATCH {expected}" in sbatch, sorted(sbatch)
    assert f"#SBATCH --array=0-{CASES - 1}%2" in sbatch, sorted(sbatch)


def _cancel_when_submitted(out: Path, node_id: str, stop: threading.Event) -> None:
    """scancel the case's job as soon as its id is written (the sweep is running then)."""
    while not stop.wait(0.5):
        job_id = case_files(out, node_id).read_status().get("job_id")
        if job_id:
            subprocess.run(["scancel", job_id], timeout=30)
            return


def test_a_cancelled_job_is_resumed(slurm, tmp_path: Path) -> None:
    out = tmp_path / "sweep"
    collected = run([sys.executable, "-m", "pytest", "--collect-only", "-q", *SELECTION])
    node_ids = [line for line in collected.stdout.splitlines() if "::" in line]
    assert len(node_ids) == CASES, collected.stdout
    stop = threading.Event()
    # One at a time: the second case is still pending when it is cancelled.
    canceller = threading.Thread(target=_cancel_when_submitted, args=(out, node_ids[1], stop), daemon=True)
    canceller.start()
    try:
        first = run(sweep_command(out, parallelism=1))
    finally:
        stop.set()
        canceller.join(timeout=30)
    assert first.returncode == 1, first.stdout[-2000:] + first.stderr[-2000:]
    assert "1 case(s) failed" in first.stdout and "cancel" in first.stdout.lower(), first.stdout[-2000:]
    rows = json.loads((out / "sweep.json").read_text())["benchmarks"]
    assert "failed" in rows[1]["extra_info"]["skipped"]
    started = time.monotonic()
    again = run(sweep_command(out, parallelism=1))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"{CASES} case(s) selected, 1 done earlier, 1 to run" in again.stdout
    rows = json.loads((out / "sweep.json").read_text())["benchmarks"]
    assert [r["fullname"] for r in rows] == node_ids and all("job" in r["extra_info"] for r in rows)
    assert time.monotonic() - started < 480


def _standin_sweep(*extra: str) -> list[str]:
    command = sweep("test_standin.py", "--out", "out", "--executor", "slurm", "--partition", "debug")
    return [*command, "--cpus-per-job", "1", *extra]


@pytest.mark.timeout(400)
def test_a_job_past_its_2_minute_limit_ends_by_the_suites_limit(slurm, tmp_path: Path) -> None:
    """submitit's USR2 came 90 s before the limit, and Slurm sends it up to 30 s earlier still: a
    2-minute job was ended by it ("Job not requeued because: timed-out too many times") before the
    suite's own limit (the limit less 30 s) fired."""
    write_bench(tmp_path, ("slow1",))
    started = time.monotonic()
    done = subprocess.run(
        _standin_sweep("--time-min", "2"),
        cwd=tmp_path,
        env=standin_env(),
        capture_output=True,
        text=True,
        timeout=360,
    )
    took = time.monotonic() - started
    assert done.returncode == 1, done.stdout[-2000:] + done.stderr[-2000:]
    status = case_files(tmp_path / "out", node_id("slow1")).read_status()
    assert status["state"] == "timed out", status
    assert status["error"].startswith("pytest ran past the suite's limit of 65 s"), status
    assert "requeued" not in status["error"] and "\n" not in status["error"], status
    assert "jobs: 0 pending 0 running 0 done 0 failed 1 timed out" in done.stdout, done.stdout
    assert took < 120 + 60, f"{took:.0f} s"  # the job's limit and the queue's start, at most


def test_a_partition_the_cluster_lacks_is_one_line(slurm, tmp_path: Path) -> None:
    write_bench(tmp_path, ("quick",))
    command = sweep("test_standin.py", "--out", "out", "--executor", "slurm", "--partition", "gpu")
    done = subprocess.run(
        command, cwd=tmp_path, env=standin_env(), capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    (line,) = done.stderr.strip().splitlines()
    assert line.startswith("sweep: sbatch refused the jobs: invalid partition specified: gpu"), line
    assert "partitions debug* (no GRES)" in line and "sinfo" in line, line


@pytest.mark.timeout(400)
def test_an_interrupted_slurm_sweep_cancels_its_jobs_and_keeps_what_finished(slurm, tmp_path: Path) -> None:
    write_bench(tmp_path, ("quick", "slow1"))
    proc = start(_standin_sweep("--time-min", "5", "--parallelism", "2"), tmp_path, tmp_path / "log")
    try:
        wait_until(
            lambda: case_files(tmp_path / "out", node_id("quick")).read_status().get("state") == "done",
            240,
            "quick done",
        )
        wait_until((tmp_path / "slow1.pid").is_file, 120, "slow1 running")
        interrupt(proc, signal.SIGINT)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    output = (tmp_path / "log").read_text()
    assert rc == 130 and "Traceback" not in output, output[-3000:]
    slow = case_files(tmp_path / "out", node_id("slow1")).read_status()
    assert slow["state"] == "cancelled", slow
    wait_until(
        lambda: not alive(int((tmp_path / "slow1.pid").read_text())), 60, "the cancelled job's pytest to end"
    )
    queued = ["squeue", "-h", "-j", slow["job_id"]]
    wait_until(
        lambda: not subprocess.run(queued, capture_output=True, text=True).stdout.strip(), 60, "the job gone"
    )
    (tmp_path / "fast").touch()
    again = subprocess.run(
        _standin_sweep("--time-min", "5"),
        cwd=tmp_path,
        env=standin_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "2 case(s) selected, 1 done earlier, 1 to run" in again.stdout, again.stdout
