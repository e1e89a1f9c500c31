"""The job layer under sweeps and classes (``jobs/run.py``, ``jobs/executor.py``) with stand-in
work: the counts line, each running job told for its progress, a job Slurm cancelled or has not
accounted for yet named as such (stand-in ``sacct`` and ``squeue``), and the time a job is given."""

from __future__ import annotations

import re
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from cs336_systems.jobs.executor import ExecutorConfig, make_executor
from cs336_systems.jobs.run import Watch, job_outcome, job_phase, run_jobs

pytestmark = pytest.mark.timeout(120)


def _sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def test_the_counts_never_show_a_free_slot_while_jobs_wait(tmp_path: Path) -> None:
    """A job that ended and the next one started are one change: the line between them said "2 pending
    0 running 1 done", a slot free while jobs waited."""
    lines: list[str] = []
    config = ExecutorConfig(kind="local", folder=tmp_path, parallelism=1, poll_s=0.2)
    calls = {k: (lambda: _sleep(0.5)) for k in "abc"}
    ends = run_jobs(config, calls, Watch(log=lines.append))
    assert [e.state for e in ends.values()] == ["done"] * 3
    for line in lines:
        pending, running = map(int, re.match(r"jobs: (\d+) pending (\d+) running", line).groups())
        assert not (pending and running < 1), lines
    assert lines[-1] == "jobs: 0 pending 0 running 3 done 0 failed", lines


def test_each_running_job_is_told_at_each_look(tmp_path: Path) -> None:
    """What a class's per-repository progress lines hang on, on Slurm as on one machine."""
    told: list[tuple[str, float]] = []
    config = ExecutorConfig(kind="local", folder=tmp_path, poll_s=0.1)
    run_jobs(config, {"a": lambda: _sleep(1.5)}, Watch(running=lambda k, s: told.append((k, s)), log=print))
    assert told and {k for k, _ in told} == {"a"}, told
    assert told[-1][1] > 0.5 and [s for _, s in told] == sorted(s for _, s in told), told


def test_a_job_sacct_has_not_seen_yet_is_pending() -> None:
    """Just submitted, a Slurm job's state is UNKNOWN: "0 pending 4 running" before anything started."""
    assert job_phase(SimpleNamespace(state="UNKNOWN", done=lambda: False)) == "pending"
    assert job_phase(SimpleNamespace(state="PENDING", done=lambda: False)) == "pending"
    assert job_phase(SimpleNamespace(state="RUNNING", done=lambda: False)) == "running"


def _ended(state: str, message: str) -> SimpleNamespace:
    return SimpleNamespace(job_id="5", state=state, exception=lambda: RuntimeError(message))


def test_a_job_that_did_not_finish_says_how() -> None:
    cancelled = _ended(
        "CANCELLED by 0",
        "Job 5 (task: 0) has not produced any output (state: CANCELLED by 0)\nError stream produced:\n"
        "----------------------\nslurmstepd: error: *** JOB 5 ON vm CANCELLED AT 2026-01-01T00:00:00 ***\n",
    )
    end = job_outcome(cancelled)
    assert end.state == "cancelled" and "CANCELLED AT" in end.error, end
    assert job_outcome(_ended("TIMEOUT", "Job 5 has not produced any output")).state == "timed out"
    ours = _ended("FAILED", "Traceback ...\ncs336_systems.jobs.interrupt.JobTimeout: pytest ran past 13 s\n")
    assert job_outcome(ours).state == "timed out" and job_outcome(ours).error == "pytest ran past 13 s"
    assert job_outcome(_ended("FAILED", "ValueError: bad")).state == "failed"


@pytest.mark.parametrize(("minutes", "lead"), [(1, 7), (2, 15), (30, 90), (60, 90)])
def test_a_jobs_warning_and_the_suites_limit_fit_its_time(minutes: int, lead: int) -> None:
    """submitit's USR2 came 90 s before any limit (at once for a 1-min job), and Slurm sends it up to
    30 s earlier still; the suite's own limit must end the work before it can come."""
    config = ExecutorConfig(kind="local", time_min=minutes)
    assert config.signal_lead_s() == lead
    assert 0 < config.work_limit_s() <= minutes * 60 - lead - 30 - 10
    assert config.work_limit_s() >= minutes * 60 * 0.2, "a limit the job can use"


def test_the_sbatch_script_asks_for_the_fitted_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")  # sbatch "installed"
    executor = make_executor(ExecutorConfig(kind="slurm", folder=tmp_path, time_min=2))
    script = executor._executor._make_submission_file_text("true", "uid")
    assert "#SBATCH --signal=USR2@15" in script and "#SBATCH --time=2" in script, script
    local = make_executor(ExecutorConfig(kind="local", folder=tmp_path, time_min=2))
    assert local.parameters["signal_delay_s"] == 15


def test_a_job_sacct_lags_behind_is_what_squeue_says(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Accounting lagged a job's start by tens of seconds: the job read as pending (or, before, as
    running before anything started). A job neither knows is failed after a grace (stand-in sacct and
    squeue)."""
    import submitit

    from cs336_systems.jobs.run import _Queue

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sacct").write_text("#!/bin/sh\nexit 0\n")  # no line for any job yet
    (bin_dir / "squeue").write_text('#!/bin/sh\ncat "$(dirname "$0")/queue"\n')
    for name in ("sacct", "squeue"):
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    (bin_dir / "queue").write_text("7_0 RUNNING\n7_1 PENDING\n")
    jobs = [submitit.SlurmJob(tmp_path, f"7_{i}") for i in range(3)]
    queue = _Queue(grace_s=0.0)
    queue.update(jobs)
    assert [job_phase(j, queue.states.get(j.job_id)) for j in jobs] == ["running", "pending", "pending"]
    time.sleep(0.01)
    assert [queue.gone(j) for j in jobs] == [False, False, True]
    (bin_dir / "queue").write_text("7_2 PENDING\n")
    queue.update(jobs)
    assert not queue.gone(jobs[2]), "known to squeue again"
