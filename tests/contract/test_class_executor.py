"""A class through the executor (``cli.grade ... --executor local``, submitit's LocalExecutor) gives the
same class report rows as the one-machine run of the same command and seed; a job that dies is its
repository's row; a local job claims a GPU no other holds; and one repository goes through a real Slurm
(``--executor slurm``; skipped with the reason where the one-node cluster cannot start), where a
repository says its progress and a cancelled job is named so."""

from __future__ import annotations

import csv
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from cs336_systems.grading import gradescope
from cs336_systems.jobs.executor import ExecutorConfig, GpuClaimError, claim_gpus

from ..helpers.standin import wait_until
from .grading_run import ROOT, STUDENTS, clean_env

# One xdist group (tox runs `--dist loadgroup`): the module runs in one worker, which makes its
# fixture's two class runs once rather than once per worker.
pytestmark = [pytest.mark.timeout(500), pytest.mark.xdist_group("test_class_executor")]
# --jobs 3: the executor runs as many jobs at once as the one-machine run has slots.
COMMON = ["--tiers", "course", "--timeout", "300", "--seed", "11", "--jobs", "3"]
PYTORCH_COURSE = ["--", "-k", "course-pytorch"]  # one quick case per repository


def _grade(targets: list[Path], out: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", *map(str, targets), "--out", str(out)]
    cmd += [*COMMON, *extra, *PYTORCH_COURSE]
    return subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=400)


def _rows(out: Path) -> list[list[str]]:
    """The class sheet's rows: repository, score, max score, each hook group's verdict, why not graded."""
    return list(csv.reader((out / "class.csv").read_text().splitlines()))


@pytest.fixture(scope="module")
def class_runs(
    tmp_path_factory: pytest.TempPathFactory,
) -> dict[str, tuple[subprocess.CompletedProcess, Path]]:
    root = tmp_path_factory.mktemp("classexec")
    broken = root / "broken"  # does not parse: a row of its own, found before any worker starts
    (broken / "tests").mkdir(parents=True)
    (broken / "tests" / "adapters.py").write_text("def get_ddp(:\n")
    targets = [STUDENTS / "src_layout", STUDENTS / "crashes", broken]
    runs = {}
    # Side by side: the CPU is shared, and the two runs are independent.
    threads = [
        threading.Thread(
            target=lambda k=kind, e=extra: runs.update({k: (_grade(targets, root / k, *e), root / k)})
        )
        for kind, extra in (("one_machine", []), ("executor", ["--executor", "local"]))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return runs


def test_the_executor_gives_the_one_machine_report(class_runs) -> None:
    (plain, plain_out), (jobs, jobs_out) = class_runs["one_machine"], class_runs["executor"]
    # 1: a repository (broken) could not be graded, in both runs.
    assert plain.returncode == jobs.returncode == 1, jobs.stdout[-3000:] + jobs.stderr[-2000:]
    assert "3 job(s) on this machine, 3 at a time" in jobs.stdout, jobs.stdout[-3000:]
    assert "jobs: 0 pending 0 running 3 done 0 failed" in jobs.stdout, jobs.stdout[-3000:]
    rows = _rows(jobs_out)
    assert [r[0] for r in rows[1:]] == ["src_layout", "crashes", "broken"], rows
    assert rows == _rows(plain_out)
    by_name = {r[0]: r for r in rows[1:]}
    assert by_name["src_layout"][1:] == ["5", "5", "ok"] and by_name["crashes"][1] == "0", rows
    assert "does not parse" in by_name["broken"][-1], rows
    assert not (jobs_out / "src_layout" / "failure.txt").exists(), "graded within its time limit"
    assert (jobs_out / "class.md").read_text() == (plain_out / "class.md").read_text()
    for name in by_name:
        doc = json.loads((jobs_out / name / "results.json").read_text())
        assert gradescope.problems(doc) == [], (name, gradescope.problems(doc))
    assert list((jobs_out / "jobs").glob("*_log.out")), "submitit's job folder holds each job's log"


def test_a_rerun_through_the_executor_skips_what_is_up_to_date(class_runs) -> None:
    _, out = class_runs["executor"]
    again = _grade([STUDENTS / "src_layout"], out, "--executor", "local")
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "[src_layout] up to date" in again.stdout and "job(s)" not in again.stdout, again.stdout


def _run_class(tmp_path: Path, timeout: float, gpus_per_job: int) -> tuple[dict[str, str], Path]:
    from cs336_systems.grading.class_run.class_executor import ClassJobs, run_class
    from cs336_systems.grading.limits import Limits
    from cs336_systems.grading.repo.repo_job import RepoOptions
    from cs336_systems.jobs.executor import ExecutorConfig

    out = tmp_path / "out"
    config = ExecutorConfig(kind="local", folder=out / "jobs", gpus_per_job=gpus_per_job, poll_s=0.2)
    options = RepoOptions(limits=Limits(timeout))
    jobs = ClassJobs({"repo": STUDENTS / "src_layout"}, out, options, config, local_gpus=1)
    return run_class(jobs, say=lambda line: None), out / "repo"


@pytest.mark.parametrize(
    ("timeout", "gpus_per_job", "why"),
    [
        (2.0, 0, "grading failed: timed out after 2 s"),  # the grading process, stopped by its job
        (60.0, 2, "grading failed: job "),  # the job itself failed (it asked for 2 of 1 GPU)
    ],
)
def test_a_job_that_fails_is_its_repositorys_row(
    tmp_path: Path, timeout: float, gpus_per_job: int, why: str
) -> None:
    outcomes, out = _run_class(tmp_path, timeout, gpus_per_job)
    assert outcomes["repo"].startswith(why), outcomes
    doc = json.loads((out / "results.json").read_text())
    assert "grader failed" in [t["name"] for t in doc["tests"]], doc
    assert gradescope.problems(doc) == [] and (out / "failure.txt").is_file()


def test_local_jobs_claim_distinct_gpus(tmp_path: Path) -> None:
    with claim_gpus(tmp_path, total=2, wanted=1) as first, claim_gpus(tmp_path, total=2, wanted=1) as second:
        assert first != second and sorted(first + second) == [0, 1]
    with pytest.raises(GpuClaimError, match="this machine has 2 GPU"), claim_gpus(tmp_path, 2, 3):
        pass


def test_one_repository_through_slurm(slurm, tmp_path: Path) -> None:
    out = tmp_path / "class"
    run = _grade(
        [STUDENTS / "src_layout"], out, "--executor", "slurm", "--partition", "debug", "--cpus-per-job", "1"
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    assert "1 job(s) on Slurm partition debug" in run.stdout, run.stdout[-3000:]
    rows = _rows(out)
    assert [r[:2] for r in rows[1:]] == [["src_layout", "5"]], rows
    sbatch = {ln for s in (out / "jobs").glob("*_submission.sh") for ln in s.read_text().splitlines()}
    assert "#SBATCH --partition=debug" in sbatch and "#SBATCH --cpus-per-task=1" in sbatch, sorted(sbatch)


def test_a_one_machine_scheduler_names_gpus_among_those_it_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    from cs336_systems.grading.class_run.classroom import repo_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert repo_env(1, 1, [])["CUDA_VISIBLE_DEVICES"] == "3"  # "1" would be another user's GPU
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert repo_env(1, 1, [])["CUDA_VISIBLE_DEVICES"] == "1"


@pytest.mark.parametrize("anchors_fail", [False, True])
def test_on_one_machine_the_anchors_join_the_class_queue(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, anchors_fail: bool
) -> None:
    """The anchors job is the last of the one queue, so it starts on the first GPU a repository frees;
    run after the class, its whole time was added to the class's. A model it did not time (here: its job
    failed) is timed after the class."""
    from cs336_systems.grading.class_run import class_executor
    from cs336_systems.grading.class_run.class_executor import ANCHORS, ClassJobs, run_class
    from cs336_systems.grading.repo.repo_job import RepoOptions
    from cs336_systems.jobs.executor import ExecutorConfig
    from cs336_systems.jobs.run import Outcome

    queues: list[list[str]] = []

    def run_jobs(config, calls, watch):  # what each job would have returned, told as each ends
        queues.append(list(calls))
        ends = {}
        for key, call in calls.items():
            if key == ANCHORS:
                rows = [{"name": "suite", "gpu": "Fake GPU"}]
                (call.out / "gpu0.json").write_text(json.dumps({"rows": rows}))
                ends[key] = Outcome("1", "done", result={"code": int(anchors_fail)})
            else:
                ends[key] = Outcome(
                    "2", "done", result={"code": 0, "elapsed": 1.0, "host": "h", "gpu": "Fake GPU"}
                )
            watch.ended(key, ends[key])
        return ends

    monkeypatch.setattr(class_executor, "run_jobs", run_jobs)
    out = tmp_path / "out"
    config = ExecutorConfig(kind="local", folder=out / "jobs", gpus_per_job=1, parallelism=2)
    repos = {"a": STUDENTS / "src_layout", "b": STUDENTS / "crashes"}
    run_class(ClassJobs(repos, out, RepoOptions(bench=True), config, local_gpus=2), say=lambda line: None)
    assert queues[0] == ["a", "b", ANCHORS], queues
    assert queues[1:] == ([["Fake GPU"]] if anchors_fail else []), queues


def _raises() -> None:
    raise ValueError("tuple index out of range")


def test_a_job_that_raises_names_its_error(tmp_path: Path) -> None:
    """The outcome names the exception and the job's log (submitit's message ends with its log paths,
    and the error once shown was only those)."""
    from cs336_systems.jobs.executor import ExecutorConfig
    from cs336_systems.jobs.run import Watch, run_jobs

    config = ExecutorConfig(kind="local", folder=tmp_path / "jobs", poll_s=0.2)
    (end,) = run_jobs(config, {"job": _raises}, Watch(log=lambda line: None)).values()
    assert end.state == "failed", end
    assert "ValueError: tuple index out of range" in end.error and "_log.err" in end.error, end.error


def test_local_jobs_share_the_machines_cores_with_or_without_gpus(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from cs336_systems.grading.class_run import class_executor
    from cs336_systems.grading.class_run.class_executor import ClassJobs, run_class
    from cs336_systems.grading.repo.repo_job import RepoOptions
    from cs336_systems.jobs.executor import ExecutorConfig
    from cs336_systems.jobs.run import Outcome

    threads: list[int | None] = []

    def run_jobs(config, calls, watch):
        threads.extend(call.threads for call in calls.values())
        ends = {k: Outcome("1", "done", result={"code": 0, "elapsed": 1.0, "host": "h"}) for k in calls}
        for key, end in ends.items():
            watch.ended(key, end)
        return ends

    monkeypatch.setattr(class_executor, "run_jobs", run_jobs)
    config = ExecutorConfig(kind="local", folder=tmp_path / "jobs", parallelism=2)
    repos = {"a": STUDENTS / "src_layout"}
    run_class(ClassJobs(repos, tmp_path / "out", RepoOptions(), config), say=lambda line: None)
    assert threads == [max(1, (os.cpu_count() or 2) // 2)], threads


def test_local_jobs_are_looked_at_as_often_as_the_one_machine_scheduler_looks(monkeypatch) -> None:
    """A job that ended is seen, and the next one started, at the next look: at 2 s (Slurm's cadence, one
    sacct a look) a class of three ran 3-4 s longer than the one-machine scheduler's 0.5 s."""
    from cs336_systems.grading.class_run import classroom

    assert ExecutorConfig(kind="local").poll_interval() <= classroom.POLL_S
    assert ExecutorConfig(kind="local", poll_s=0.2).poll_interval() == 0.2
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")  # sbatch "installed"
    assert ExecutorConfig(kind="slurm").poll_interval() == 2.0


@pytest.mark.timeout(300)
def test_on_slurm_a_repository_says_its_progress_and_a_cancelled_job_is_named_so(
    slurm, tmp_path: Path
) -> None:
    """A class on Slurm said its job counts only; a job cancelled with ``scancel`` read "the grading
    process died (exit -15): (no output)" and counted as done."""
    out, log = tmp_path / "class", tmp_path / "log"
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", str(STUDENTS / "hangs"), "--out", str(out)]
    cmd += [*COMMON, "--executor", "slurm", "--partition", "debug", "--cpus-per-job", "1", *PYTORCH_COURSE]
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=clean_env(), stdout=f, stderr=subprocess.STDOUT)
    try:
        wait_until(lambda: "[hangs] " in log.read_text(), 240, "a progress line of hangs")
        (submitted,) = (out / "jobs").glob("*_submitted.pkl")
        subprocess.run(["scancel", submitted.name.split("_")[0]], check=True, timeout=60)
        rc = proc.wait(timeout=120)
    finally:
        proc.kill()
    output = log.read_text()
    progress = [ln for ln in output.splitlines() if ln.startswith("[hangs] ") and ln.endswith(" s")]
    assert progress and "grading failed" not in progress[0], output[-3000:]  # what runs, while it runs
    assert "[hangs] grading failed: cancelled (job " in output and "exit -15" not in output, output[-3000:]
    assert "jobs: 0 pending 0 running 0 done 0 failed 1 cancelled" in output, output[-3000:]
    assert rc == 2, output[-3000:]  # not graded at all (the exit rule cli.grade's help gives)
    assert (out / "hangs" / "unfinished.txt").is_file(), "the next run grades it again"


@pytest.mark.parametrize(("code_age_s", "submitted"), [(-60, True), (60, False)])
def test_the_executor_regrades_a_repository_whose_code_is_newer_than_its_results(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code_age_s: int, submitted: bool
) -> None:
    """A rerun keeps results newer than every file of the code, and grades again a repository whose
    code changed after them (``code_age_s`` < 0: edited a minute after its results were written)."""
    import os
    import shutil

    from cs336_systems.grading.class_run import class_executor
    from cs336_systems.grading.class_run.class_executor import ClassJobs, run_class
    from cs336_systems.grading.class_run.classroom import options_json
    from cs336_systems.grading.repo.repo_job import RepoOptions
    from cs336_systems.jobs.run import Outcome

    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    out = tmp_path / "out"
    (out / "repo").mkdir(parents=True)
    results = out / "repo" / "results.json"
    results.write_text(json.dumps(gradescope.results({"cases": []}, gradescope.load_points(None))))
    (out / "repo" / "options.json").write_text(json.dumps(options_json(RepoOptions())))  # same selection
    when = results.stat().st_mtime - code_age_s
    for path in repo.rglob("*"):
        os.utime(path, (when, when))
    queues: list[list[str]] = []

    def run_jobs(config, calls, watch):
        queues.append(list(calls))
        ends = {k: Outcome("1", "done", result={"code": 0, "elapsed": 1.0, "host": "h"}) for k in calls}
        for key, end in ends.items():
            watch.ended(key, end)
        return ends

    monkeypatch.setattr(class_executor, "run_jobs", run_jobs)
    config = ExecutorConfig(kind="local", folder=out / "jobs")
    outcomes = run_class(ClassJobs({"repo": repo}, out, RepoOptions(), config), say=lambda line: None)
    assert queues == ([["repo"]] if submitted else []), (queues, outcomes)
    assert outcomes["repo"].startswith("up to date") != submitted, outcomes
