"""A class interrupted, or whose jobs did not finish: Ctrl-C during a class (one machine, and through the
executor) stops what runs with one line and no process left, keeps the repository that finished, and the
rerun grades only the other; a repository whose job was cancelled, timed out or failed is graded again
by the next run (stand-in job ends); a repository graded as a job says its progress while it runs."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.grading.class_run.class_executor import ClassJobs, run_class
from cs336_systems.grading.class_run.classroom import record_failure, up_to_date
from cs336_systems.grading.limits import Limits
from cs336_systems.grading.repo.repo_job import RepoOptions
from cs336_systems.jobs.executor import ExecutorConfig
from cs336_systems.jobs.run import Outcome

from ..helpers.standin import interrupt, processes_naming, wait_until
from .grading_run import ROOT, STUDENTS, clean_env

PYTORCH_COURSE = ["--", "-k", "course-pytorch"]  # one quick case per repository


def _command(out: Path, timeout: int, *extra: str) -> list[str]:
    repos = [str(STUDENTS / "src_layout"), str(STUDENTS / "hangs")]
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", *repos, "--out", str(out), "--jobs", "2"]
    return [*cmd, "--tiers", "course", "--timeout", str(timeout), *extra, *PYTORCH_COURSE]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("extra", [[], ["--executor", "local"]], ids=["one-machine", "executor"])
def test_an_interrupted_class_regrades_only_what_did_not_finish(tmp_path: Path, extra: list[str]) -> None:
    out, log = tmp_path / "out", tmp_path / "first.log"
    with log.open("w") as f:  # its own process group, as a terminal runs it: Ctrl-C reaches the group
        proc = subprocess.Popen(
            _command(out, 300, *extra),
            cwd=ROOT,
            env=clean_env(),
            stdout=f,
            stderr=subprocess.STDOUT,
            process_group=0,
        )
    try:
        # the class has taken src_layout's end (its results written, its process gone, its outcome said)
        wait_until(lambda: "[src_layout] graded" in log.read_text(), 300, "src_layout graded")
        wait_until((out / "hangs" / "job.log").is_file, 60, "hangs started")
        interrupt(proc, signal.SIGINT)
        rc = proc.wait(timeout=60)
    finally:
        proc.kill()
    output = log.read_text()
    assert rc == 130, output[-3000:]
    assert "Traceback" not in output and "KeyboardInterrupt" not in output, output[-3000:]
    said = [line for line in output.splitlines() if "interrupted by SIGINT" in line]
    assert len(said) == 2 and said[0].startswith("[hangs] grading failed: cancelled"), output[-3000:]
    assert said[1].endswith(
        "interrupted by SIGINT: 1 repositories ended and kept, 1 cancelled; rerun the same command to run the rest"
    ), output[-3000:]
    assert processes_naming(str(out)) == [], "a repository's grading outlived the class run"
    hangs = json.loads((out / "hangs" / "results.json").read_text())
    assert any("cancelled" in t["output"] for t in hangs["tests"] if t["name"] == "grader failed"), hangs
    assert (out / "hangs" / "unfinished.txt").is_file() and not (
        out / "src_layout" / "unfinished.txt"
    ).exists()
    graded = (out / "src_layout" / "results.json").stat().st_mtime
    again = subprocess.run(
        _command(out, 5, *extra), cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=300
    )
    assert "[src_layout] up to date" in again.stdout, again.stdout[-3000:]
    assert (out / "src_layout" / "results.json").stat().st_mtime == graded
    assert "[hangs] grading failed: timed out after 5 s" in again.stdout, again.stdout[-3000:]


def _class(tmp_path: Path, run_jobs, progress_s: float = 15.0) -> tuple[dict[str, str], list[str]]:
    """``run_class`` of one repository with ``run_jobs`` standing in for the jobs."""
    import cs336_systems.grading.class_run.class_executor as class_executor

    said: list[str] = []
    config = ExecutorConfig(kind="local", folder=tmp_path / "jobs")
    jobs = ClassJobs(
        {"a": STUDENTS / "src_layout"},
        tmp_path / "out",
        RepoOptions(limits=Limits(60.0)),
        config,
        progress_s=progress_s,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(class_executor, "run_jobs", run_jobs)
        return run_class(jobs, say=said.append), said


@pytest.mark.parametrize(
    ("state", "error", "reads"),
    [
        ("cancelled", "CANCELLED by 0: slurmstepd: error: *** JOB 5 CANCELLED ***", "cancelled (job 5)"),
        ("timed out", "TIMEOUT: DUE TO TIME LIMIT", "TIMEOUT"),
        ("failed", "FAILED: ValueError: bad", "job 5 failed"),
    ],
)
def test_a_repository_whose_job_did_not_finish_is_graded_again(
    tmp_path: Path, state: str, error: str, reads: str
) -> None:
    def run_jobs(config, calls, watch):
        ends = {key: Outcome("5", state, error=error) for key in calls}
        for key, end in ends.items():
            watch.ended(key, end)
        return ends

    outcomes, said = _class(tmp_path, run_jobs)
    assert outcomes["a"].startswith(f"grading failed: {reads}"), outcomes
    assert any(line.startswith(f"[a] grading failed: {reads}") for line in said), said
    results = json.loads((tmp_path / "out" / "a" / "results.json").read_text())
    assert next(t["output"] for t in results["tests"] if t["name"] == "grader failed").startswith(reads)
    assert not up_to_date(STUDENTS / "src_layout", tmp_path / "out" / "a", RepoOptions()), (
        "its results say it did not finish"
    )


def test_a_repository_timed_out_on_one_machine_is_graded_again(tmp_path: Path) -> None:
    out = tmp_path / "a"
    out.mkdir()
    record_failure(out, "timed out after 45 s", None)  # what the one-machine class run writes then
    assert (out / "results.json").is_file() and not up_to_date(STUDENTS / "src_layout", out, RepoOptions())


def test_a_repository_graded_as_a_job_says_its_progress(tmp_path: Path) -> None:
    """On Slurm a class said its job counts only: each repository's progress file is read as on one
    machine (the files are on the shared filesystem)."""

    def run_jobs(config, calls, watch):
        progress = tmp_path / "out" / "a" / "progress.jsonl"
        progress.write_text(
            json.dumps({"case": "c", "hook": "pytorch", "tier": "course", "status": "passed"})
        )
        for seconds in (0.5, 1.0, 2.5):
            watch.running("a", seconds)
        end = Outcome("5", "done", result={"code": 0, "elapsed": 3.0, "host": "h"})
        watch.ended("a", end)
        return {"a": end}

    _, said = _class(tmp_path, run_jobs, progress_s=1.0)
    progress = [line for line in said if "cases done" in line]
    assert progress == [
        "[a] 1 cases done, last pytorch course (passed), 1 s",
        "[a] 1 cases done, last pytorch course (passed), 2 s",
    ], said
