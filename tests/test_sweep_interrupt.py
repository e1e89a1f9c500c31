"""A sweep interrupted, or out of time, on this machine (submitit's LocalExecutor, the code path a Slurm
sweep takes too), with a stand-in bench file (no torch: each case is a pytest run of a few lines):
Ctrl-C or ``kill`` cancels the running jobs, keeps the finished case and leaves no process behind, in
one line; the rerun runs only the others; a case past the suite's own limit ends by it, with its reason;
sbatch's refusal of a partition is one line (a stand-in ``sbatch`` and ``sinfo``)."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest

from cs336_systems.harness.sweep import case_files

from .helpers.standin import (
    alive,
    env,
    interrupt,
    node_id,
    processes_naming,
    start,
    sweep,
    wait_until,
    write_bench,
)

pytestmark = pytest.mark.timeout(300)
CASES = ("quick", "slow1", "slow2", "slow3")


def _local(out: str, *extra: str) -> list[str]:
    return sweep("test_standin.py", "--out", out, "--executor", "local", "--parallelism", "4", *extra)


def _status(folder: Path, case: str) -> dict:
    return case_files(folder / "out", node_id(case)).read_status()


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "kill"])
def test_an_interrupted_sweep_keeps_what_finished_and_reruns_only_the_rest(
    tmp_path: Path, signum: int
) -> None:
    write_bench(tmp_path, CASES)
    proc = start(_local("out", "--time-min", "5"), tmp_path, tmp_path / "first.log")
    try:
        bench = case_files(tmp_path / "out", node_id("quick")).bench
        wait_until(bench.is_file, 120, "the quick case's bench.json")
        wait_until(lambda: all((tmp_path / f"{c}.pid").is_file() for c in CASES), 60, "every case to start")
        time.sleep(2)  # the sweep looks at its jobs every 0.5 s: it has seen the quick one end
        interrupt(proc, signum)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    output = (tmp_path / "first.log").read_text()
    assert rc == 128 + signum, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "interrupted by" in line]
    assert said == [
        f"sweep: interrupted by {signal.Signals(signum).name}: 1 case(s) ended and kept, 3 cancelled;"
        " rerun the same command to run the rest"
    ], output[-3000:]
    assert _status(tmp_path, "quick")["state"] == "done"
    assert [_status(tmp_path, c)["state"] for c in CASES[1:]] == ["cancelled"] * 3
    pids = {c: int((tmp_path / f"{c}.pid").read_text()) for c in CASES}
    assert not [c for c, pid in pids.items() if alive(pid)], "a cancelled case's pytest outlived its job"
    assert processes_naming(str(tmp_path)) == [], "the jobs' controllers outlived the sweep"
    (tmp_path / "fast").touch()
    again = subprocess.run(
        _local("out", "--time-min", "5"), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=200
    )
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert "4 case(s) selected, 1 done earlier, 3 to run" in again.stdout, again.stdout
    assert int((tmp_path / "quick.pid").read_text()) == pids["quick"], "the finished case ran again"


def test_a_case_past_the_suites_limit_ends_by_it_with_its_reason(tmp_path: Path) -> None:
    """``--time-min 1``: submitit's warning (USR2) used to come 30 s before the end, at the moment the
    suite's own limit (the limit less 30 s) fired; the suite's limit now ends the work first."""
    write_bench(tmp_path, ("slow1",))
    started = time.monotonic()
    run = subprocess.run(
        _local("out", "--time-min", "1"), cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=200
    )
    took = time.monotonic() - started
    assert run.returncode == 1, run.stdout[-3000:] + run.stderr[-2000:]
    status = _status(tmp_path, "slow1")
    assert status["state"] == "timed out", status
    error = status["error"]
    assert "pytest ran past the suite's limit of 13 s" in error and "\n" not in error, error
    assert "requeued" not in error, error
    assert f"timed out: {node_id('slow1')}: pytest ran past" in run.stdout, run.stdout
    assert "jobs: 0 pending 0 running 0 done 0 failed 1 timed out" in run.stdout, run.stdout
    assert took < 50, f"{took:.0f} s: the job's 1-min limit, not the suite's, ended it"
    assert not alive(int((tmp_path / "slow1.pid").read_text()))
    row = json.loads((tmp_path / "out" / "sweep.json").read_text())["benchmarks"][0]
    assert row["extra_info"]["job_state"] == "timed out", row


def test_a_partition_sbatch_refuses_is_one_line(tmp_path: Path) -> None:
    """The Slurm command of docs/beyond-one-machine.md where there is no partition ``gpu``: sbatch's words and the
    cluster's partitions, in one line, instead of submitit's traceback."""
    write_bench(tmp_path, ("quick",))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fakes = {
        "sbatch": 'echo "sbatch: error: invalid partition specified: gpu" >&2\n'
        'echo "sbatch: error: Batch job submission failed: Invalid partition name specified" >&2\nexit 1',
        "sinfo": 'echo "debug* (null)"',
    }
    for name, body in fakes.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    command = sweep("test_standin.py", "--out", "out", "--executor", "slurm", "--partition", "gpu")
    run = subprocess.run(
        [*command, "--gpus-per-job", "1"],
        cwd=tmp_path,
        env={**env(), "PATH": f"{bin_dir}:{env()['PATH']}"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-3000:]
    assert "Traceback" not in run.stderr, run.stderr[-3000:]
    assert run.stderr.strip().splitlines() == [
        "sweep: sbatch refused the jobs: invalid partition specified: gpu (asked: partition gpu, 1 GPU(s) per"
        " job); this cluster has partitions debug* (no GRES) (`sinfo -o '%P %G'` lists the partitions and"
        " their GRES)"
    ], run.stderr


def test_a_job_without_gpus_records_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """submitit's LocalExecutor shows a job without GPUs ``CUDA_VISIBLE_DEVICES=""``, Slurm shows it
    nothing: the rows said ``""`` in one and ``null`` in the other."""
    from cs336_systems.harness.sweep import BenchCase

    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    for shown in ("", None):
        if shown is None:
            monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
        else:
            monkeypatch.setenv("CUDA_VISIBLE_DEVICES", shown)
        result = BenchCase("b.py::t", tmp_path / "bench.json", str(fake), tmp_path, [], 30)()
        assert result["gpus"] is None, result


def test_the_help_shows_no_empty_default() -> None:
    from cs336_systems.cli.sweep import parser

    text = parser().format_help()
    assert "(default: )" not in text, text
    assert "(default: 60)" in text  # a default that is something is still shown
