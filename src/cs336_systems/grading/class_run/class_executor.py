"""A class graded as jobs (``cli.grade ... --executor local|slurm``): one submitit job per repository,
each running the process a one-machine class run starts for it (``classroom.repo_command``), then the
same per-repository files and class report.

The parent prepares each repository's folder (its options, an earlier run's results removed), submits,
and turns each job's end, as it ends, into the repository's outcome with ``classroom.job_outcome``: a
job that failed, was cancelled or ran out of time is a ``results.json`` with a visible "grader failed",
written here, never a lost class, and graded again by the next run. While a job runs, its repository's
progress lines are read from its ``progress.jsonl`` (on Slurm, through the shared filesystem) as on one
machine. SIGINT or SIGTERM cancels the jobs still running and ends the run (``Interrupted``). With
``bench``, the suite's kernel and cuDNN are timed once per GPU model among the nodes that ran students
(the model each job saw is its ``leaderboard.json``'s ``gpu``): one anchors job per model, on a node that
ran it.

On one machine submitit's ``LocalExecutor`` gives every job the same first GPUs, so a local job claims
its GPUs itself (``executor.claim_gpus``).

No torch here: the caller says how many GPUs this machine has.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import platform
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cs336_systems.jobs.executor import (
    ExecutorConfig,
    ExecutorError,
    LocalGpus,
    config_from_args,
    describe,
    gpu_claim,
)
from cs336_systems.jobs.interrupt import Interrupted, JobTimeout, work_ends_with_job
from cs336_systems.jobs.run import Outcome, Watch, run_jobs

from .. import walls
from ..limits import Limits
from ..progress import progress_line
from ..sandbox import become_subreaper, kill_descendants
from .classroom import (
    ANCHORS_WORK,
    PROGRESS_S,
    anchor_command,
    anchors_folder,
    distrust,
    graded,
    job_outcome,
    neighbours,
    past_limit,
    prepare_repo,
    record_failure,
    repo_command,
    repo_env,
    start_job,
    stop,
    to_grade,
)

if TYPE_CHECKING:
    from ..repo.repo_job import RepoOptions

STARTUP_MIN = 3  # a job's time limit beyond the repository's own: the job's start-up and cleanup


@dataclass(frozen=True)
class ClassJobs:
    """A class to grade as jobs: ``local_gpus`` is this machine's GPU count (local executor only);
    ``progress_s``, the seconds between two progress lines of one repository."""

    repos: dict[str, Path]
    out: Path
    options: RepoOptions  # its ``limits`` hold each repository's time limit (``--timeout``)
    config: ExecutorConfig
    force: bool = False
    local_gpus: int = 0
    progress_s: float = PROGRESS_S


@dataclass(frozen=True)
class ProcessJob:
    """One job: a command in a process group of its own, stopped with all it started at ``timeout_s``.
    ``threads``: its OpenMP threads (``None``: the CPUs the job was given). ``local``: the GPUs it claims
    on one machine; ``None``: the GPUs the scheduler gave."""

    name: str
    cmd: list[str]
    out_root: Path
    out: Path
    log: Path
    timeout_s: float
    threads: int | None = None
    local: LocalGpus | None = None
    hidden: tuple[Path, ...] = ()  # the class's other repositories (its workers see none of them)
    watched: tuple[Path, ...] = ()  # what must not change while it runs (``walls.Tripwire``)

    def __call__(self) -> dict[str, Any]:
        threads = self.threads or len(os.sched_getaffinity(0))
        wire = walls.Tripwire(list(self.watched)) if self.watched else None
        # SIGTERM (a cancel, scancel) ends the grading process's tree and the job, with no result: the
        # grading process dying of it read as "died (exit -15)" in a job that counted as done.
        with work_ends_with_job(), gpu_claim(self.local) as devices:
            env = repo_env(threads, None, list(self.hidden))
            if devices:
                env["CUDA_VISIBLE_DEVICES"] = devices
            become_subreaper()  # what the grading process leaves behind comes here, and is killed
            started = time.monotonic()
            job = start_job(self.name, self.cmd, env, self.log, None, self.out)
            try:
                code = _wait(job.proc, self.timeout_s, self.out)
            finally:
                kill_descendants()
        if code == "timeout":
            raise JobTimeout(f"timed out after {self.timeout_s:.0f} s")
        return {
            "changed": wire.changed()[:20] if wire else [],
            "code": code,
            "elapsed": time.monotonic() - started,
            "host": platform.node(),
            "gpus": env.get("CUDA_VISIBLE_DEVICES") or None,  # "" (submitit, no GPU) and unset alike
            "gpu": _gpu_model(self.out / "leaderboard.json"),
        }


def _wait(proc: subprocess.Popen, timeout_s: float, out: Path) -> int | str:
    """The job's exit status, or ``"timeout"`` once it ran past its limit (``classroom.past_limit``)."""
    started = time.monotonic()
    while (code := proc.poll()) is None:
        if past_limit(started, timeout_s, out):
            stop(proc)
            return "timeout"
        time.sleep(0.5)
    return code


def _gpu_model(leaderboard: Path) -> str | None:
    try:
        model = json.loads(leaderboard.read_text()).get("gpu")
    except (OSError, ValueError, AttributeError):
        return None
    return model if isinstance(model, str) and model not in ("cpu", "") else None


ANCHORS = "anchors"  # the key of the anchors job that joins a one-machine class's queue


def run_class(jobs: ClassJobs, say: Callable[[str], None] = print) -> dict[str, str]:
    """Grade every repository not up to date as a job; each one's outcome, as ``ClassRun.run``'s.

    On one machine the anchors job joins the queue last, so it starts on the first GPU a repository
    frees, beside the last repositories (as the one-machine scheduler does); timed after the class it
    added its whole time to the class's. A GPU model it did not time, and every model on Slurm, is timed
    after the class (:func:`_time_anchors`)."""
    todo, outcomes = to_grade(jobs.repos, jobs.out, jobs.options, jobs.force, say)
    if not todo:
        return outcomes
    config = jobs.config
    local = _local_gpus(jobs)
    # On one machine the jobs share its cores; on Slurm each has the CPUs it was given.
    one_machine = config.resolved_kind() == "local"
    threads = max(1, (os.cpu_count() or 2) // config.parallelism) if one_machine else None
    # A job's own limit on Slurm (the executor's work limit) caps the repository's: its inner shares follow.
    limits = Limits(min(jobs.options.limits.repository_s, config.work_limit_s()))
    timeout_s = limits.repository_s
    watched = tuple(walls.watched(list(jobs.repos.values())))  # one list for the class: every job's tripwire
    calls = {}
    for name, target in todo.items():
        out, options = prepare_repo(jobs.out, name, dataclasses.replace(jobs.options, limits=limits))
        cmd = repo_command(target, out, options)
        hidden = tuple(neighbours(jobs.repos, name))
        calls[name] = ProcessJob(
            name, cmd, jobs.out, out, out / "job.log", timeout_s, threads, local, hidden, watched
        )
    anchors = anchors_folder(jobs.out) if jobs.options.bench and local else None
    if anchors is not None:
        calls[ANCHORS] = _anchors_job(jobs, anchors, 0, config.work_limit_s(), threads, local)
    say(f"grade: {describe(config, list(calls), timeout_s)}")
    started = time.monotonic()
    told = _ClassWatch(jobs, timeout_s, outcomes, say)
    try:
        run_jobs(config, calls, told.watch())
    except Interrupted as stopped:  # a job cancelled after its repository's results were written kept them
        stopped.kept, stopped.cancelled = stopped.kept + told.kept, stopped.cancelled - told.kept
        raise
    timed = _anchors_outcome(anchors, 0, told.anchors, say) if anchors and told.anchors else set()
    untimed = {model: host for model, host in told.seen.items() if model not in timed}
    if jobs.options.bench and untimed:
        _time_anchors(jobs, anchors or anchors_folder(jobs.out), untimed, threads, local, say)
    many = "repository" if len(todo) == 1 else "repositories"
    say(f"{len(todo)} {many} graded as jobs in {time.monotonic() - started:.0f} s")
    return outcomes


class _ClassWatch:
    """What the class hears from its jobs: each repository's outcome written as its job ends (so an
    interrupted class keeps what finished), and its progress lines while it runs."""

    def __init__(
        self, jobs: ClassJobs, timeout_s: float, outcomes: dict[str, str], say: Callable[[str], None]
    ):
        self.jobs, self.timeout_s, self.outcomes, self.say = jobs, timeout_s, outcomes, say
        self.seen: dict[str, str] = {}  # GPU model -> a node that ran it
        self.anchors: Outcome | None = None  # the anchors job's end, where it joined the queue
        self.said_at: dict[str, float] = {}
        self.kept = 0  # repositories whose job was cancelled after their results were written

    def watch(self) -> Watch:
        return Watch(ended=self.ended, running=self.running, log=self.say)

    def ended(self, name: str, end: Outcome) -> None:
        if name == ANCHORS:
            self.anchors = end
            return
        self.outcomes[name] = repo_outcome(
            self.jobs.out / name, end, self.timeout_s, self.jobs.options.points
        )
        self.kept += end.state == "cancelled" and not self.outcomes[name].startswith("grading failed")
        if end.state == "done" and end.result.get("gpu"):
            self.seen.setdefault(end.result["gpu"], end.result["host"])
        self.say(f"[{name}] {self.outcomes[name]}")

    def running(self, name: str, seconds: float) -> None:
        if seconds - self.said_at.get(name, 0.0) < self.jobs.progress_s:
            return
        self.said_at[name] = seconds
        doing = ANCHORS_WORK if name == ANCHORS else progress_line(self.jobs.out / name / "progress.jsonl")
        self.say(f"[{name}] {doing}, {seconds:.0f} s")


def repo_outcome(out: Path, end: Outcome, timeout_s: float, points: Path | None) -> str:
    """A repository's outcome from its job's: graded (its own files), or, for a job that timed out,
    was cancelled or failed, a "grader failed" record saying so (graded again by the next run)."""
    if end.state == "done" and (changed := end.result.get("changed")):
        wrote = changed[0] + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        return distrust(out, f"could not be trusted: wrote {wrote}", points)
    if end.state == "done":
        return job_outcome(out, end.result["code"], end.result["elapsed"], timeout_s, points)
    if end.state == "cancelled" and graded(out):
        return f"graded (its job {end.job_id} was cancelled after its results were written)"
    why = {
        "timed out": end.error or "timed out",
        "cancelled": f"cancelled (job {end.job_id}): {end.error}",
    }.get(end.state, f"job {end.job_id} failed: {end.error}")
    return record_failure(out, why, points)


def _local_gpus(jobs: ClassJobs) -> LocalGpus | None:
    """The GPUs of this machine the jobs claim (local executor with GPUs), else ``None``."""
    config = jobs.config
    if config.resolved_kind() != "local" or not (jobs.local_gpus and config.gpus_per_job):
        return None
    return LocalGpus.seen(jobs.out / "jobs", jobs.local_gpus, config.gpus_per_job)


def _anchors_job(
    jobs: ClassJobs, folder: Path, i: int, timeout_s: float, threads: int | None, local: LocalGpus | None
) -> ProcessJob:
    """The job that times the suite's kernel and cuDNN on one GPU into ``folder/gpu<i>.json``."""
    cmd = anchor_command(folder / f"gpu{i}.json")
    one = dataclasses.replace(local, per_job=1) if local else None
    return ProcessJob(f"anchors {i}", cmd, jobs.out, folder, folder / f"gpu{i}.log", timeout_s, threads, one)


def _anchors_outcome(folder: Path, i: int, end: Outcome, say: Callable[[str], None]) -> set[str]:
    """The GPU models ``gpu<i>.json`` holds anchors for; a failed job is said, and times none."""
    if end.error is not None or end.result["code"] != 0:
        say(f"[anchors] failed ({end.error or end.result['code']}); see {folder}/gpu{i}.log")
        return set()
    try:
        rows = json.loads((folder / f"gpu{i}.json").read_text())["rows"]
    except (OSError, ValueError, KeyError, TypeError):
        return set()
    return {r["gpu"] for r in rows if isinstance(r, dict) and isinstance(r.get("gpu"), str)}


def _time_anchors(
    jobs: ClassJobs,
    folder: Path,
    models: dict[str, str],
    threads: int | None,
    local: LocalGpus | None,
    say: Callable[[str], None],
) -> None:
    """One anchors job per GPU model in ``models`` (model -> a node that ran it), on that node, into
    ``folder/gpu<i>.json`` after those already there; ``local``: the class's claim on this machine's GPUs."""
    first = len(list(folder.glob("gpu*.json")))
    for i, (model, host) in enumerate(sorted(models.items()), start=first):
        config = dataclasses.replace(
            jobs.config,
            gpus_per_job=max(1, jobs.config.gpus_per_job),
            parallelism=1,
            slurm_params={**jobs.config.slurm_params, "nodelist": host},
        )
        call = _anchors_job(jobs, folder, i, config.work_limit_s(), threads, local)
        say(f"[anchors] timing the suite's kernel and cuDNN on {model} ({host})")
        (end,) = run_jobs(config, {model: call}, Watch(log=say)).values()
        _anchors_outcome(folder, i, end, say)


def config_for_class(
    args: argparse.Namespace, n_repos: int, local_gpus: int, job_folder: Path
) -> ExecutorConfig:
    """The executor options of ``cli.grade``, their class defaults filled in: one GPU per job where the
    nodes have GPUs, a time limit of the repository's ``--timeout`` plus start-up, and as many jobs at
    once as this machine has GPUs (or ``--jobs``) locally, every repository at once on Slurm."""
    args = argparse.Namespace(**vars(args))
    kind = ExecutorConfig(kind=args.executor).resolved_kind()
    if args.gpus_per_job is None:
        args.gpus_per_job = 1 if (local_gpus if kind == "local" else _slurm_has_gpus()) else 0
    if args.time_min is None:
        args.time_min = math.ceil(args.timeout / 60) + STARTUP_MIN
    if args.parallelism is None:
        if kind == "slurm":
            args.parallelism = max(1, n_repos)
        elif local_gpus and args.gpus_per_job:
            args.parallelism = max(1, local_gpus // args.gpus_per_job)
        else:
            args.parallelism = args.jobs or max(1, (os.cpu_count() or 2) // 2)
    if kind == "local" and args.gpus_per_job > local_gpus:
        raise ExecutorError(f"--gpus-per-job {args.gpus_per_job}: this machine has {local_gpus} GPU(s)")
    return config_from_args(args, job_folder)


def _slurm_has_gpus() -> bool:
    """Whether any node of the cluster offers a GPU (generic resources ``gpu``)."""
    if not shutil.which("sinfo"):
        return False
    found = subprocess.run(["sinfo", "-h", "-o", "%G"], capture_output=True, text=True, timeout=60)
    return "gpu" in found.stdout
