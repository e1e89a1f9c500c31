"""A class graded as jobs (``cli.grade ... --executor local|slurm``): one submitit job per repository,
each running the process a one-machine class run starts for it (``classroom.repo_command``), then the
same per-repository files and class report.

The parent prepares each repository's folder (its options, an earlier run's results removed), submits,
and turns each job's end into the repository's outcome with ``classroom.job_outcome``: a job that
failed, was cancelled or ran out of time is a ``results.json`` with a visible "grader failed", written
here, never a lost class. With ``bench``, the suite's kernel and cuDNN are timed once per GPU model among
the nodes that ran students (the model each job saw is its ``leaderboard.json``'s ``gpu``): one anchors
job per model, on a node that ran it.

On one machine submitit's ``LocalExecutor`` gives every job the same first GPUs, so a local job claims
its GPUs itself (``executor.claim_gpus``).

No torch here: the caller says how many GPUs this machine has.
"""

from __future__ import annotations

import argparse
import contextlib
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

from cs336_systems.harness.executor import (
    ExecutorConfig,
    ExecutorError,
    claim_gpus,
    config_from_args,
    describe,
    run_jobs,
)

from . import observer_turn
from .classroom import (
    _start,
    anchor_command,
    job_outcome,
    prepare_repo,
    record_failure,
    repo_command,
    repo_env,
    stop,
    up_to_date,
)
from .sandbox import become_subreaper, kill_descendants

if TYPE_CHECKING:
    from .repo_job import RepoOptions

STARTUP_MIN = 3  # a job's time limit beyond the repository's own: the job's start-up and cleanup


@dataclass(frozen=True)
class ClassJobs:
    """A class to grade as jobs: ``local_gpus`` is this machine's GPU count (local executor only)."""

    repos: dict[str, Path]
    out: Path
    options: RepoOptions
    config: ExecutorConfig
    timeout: float = 1800.0
    force: bool = False
    local_gpus: int = 0


@dataclass(frozen=True)
class ProcessJob:
    """One job: a command in a process group of its own, stopped with all it started at ``timeout_s``.
    ``threads``: its OpenMP threads (``None``: the CPUs the job was given). ``local_gpus``: claim
    ``gpus`` of them here (one machine); ``0``: use the GPUs the scheduler gave."""

    name: str
    cmd: list[str]
    out_root: Path
    out: Path
    log: Path
    timeout_s: float
    threads: int | None = None
    local_gpus: int = 0
    gpus: int = 0

    def __call__(self) -> dict[str, Any]:
        threads = self.threads or len(os.sched_getaffinity(0))
        claim = (
            claim_gpus(self.out_root / "jobs", self.local_gpus, self.gpus)
            if self.local_gpus and self.gpus
            else contextlib.nullcontext([])
        )
        with claim as gpus:
            env = repo_env(self.out_root, threads, None)
            if gpus:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
            become_subreaper()  # what the grading process leaves behind comes here, and is killed
            started = time.monotonic()
            job = _start(self.name, self.cmd, env, self.log, None, self.out)
            code = _wait(job.proc, self.timeout_s, self.out)
            kill_descendants()
        return {
            "code": code,
            "elapsed": time.monotonic() - started,
            "host": platform.node(),
            "gpus": env.get("CUDA_VISIBLE_DEVICES"),
            "gpu": _gpu_model(self.out / "leaderboard.json"),
        }


def _wait(proc: subprocess.Popen, timeout_s: float, out: Path) -> int | str:
    """The job's exit status, or ``"timeout"`` once it ran ``timeout_s`` beyond its waits for this host's
    observer (``observer_turn``): a repository is not stopped for time spent behind another's."""
    started = time.monotonic()
    while (code := proc.poll()) is None:
        if time.monotonic() - started > timeout_s + observer_turn.waited_s(out):
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


def run_class(jobs: ClassJobs, say: Callable[[str], None] = print) -> dict[str, str]:
    """Grade every repository not up to date as a job; each one's outcome, as ``ClassRun.run``'s."""
    todo = {n: p for n, p in jobs.repos.items() if jobs.force or not up_to_date(p, jobs.out / n)}
    outcomes = {
        n: "up to date (results.json newer than its code; --force regrades)"
        for n in jobs.repos
        if n not in todo
    }
    for name in outcomes:
        say(f"[{name}] {outcomes[name]}")
    if not todo:
        return outcomes
    config = jobs.config
    local = config.resolved_kind() == "local"
    # On one machine the jobs share its cores; on Slurm each has the CPUs it was given.
    threads = max(1, (os.cpu_count() or 2) // config.parallelism) if local else None
    timeout_s = min(jobs.timeout, config.time_min * 60 - 30)
    calls = {}
    for name, target in todo.items():
        out, options = prepare_repo(jobs.out, name, jobs.options)
        calls[name] = ProcessJob(
            name,
            repo_command(target, out, options),
            jobs.out,
            out,
            out / "job.log",
            timeout_s,
            threads,
            jobs.local_gpus if local else 0,
            config.gpus_per_job,
        )
    say(f"grade: {describe(config, list(calls))}")
    started = time.monotonic()
    ended = run_jobs(config, calls, log=say)
    seen: dict[str, str] = {}  # GPU model -> a node that ran it
    for name, end in ended.items():
        out = jobs.out / name
        if end.error is not None:
            outcomes[name] = record_failure(out, f"job {end.job_id} failed: {end.error}", jobs.options.points)
        else:
            result = end.result
            outcomes[name] = job_outcome(
                out, result["code"], result["elapsed"], timeout_s, jobs.options.points
            )
            if result.get("gpu"):
                seen.setdefault(result["gpu"], result["host"])
        say(f"[{name}] {outcomes[name]}")
    if jobs.options.bench and seen:
        _time_anchors(jobs, seen, threads, say)
    many = "repository" if len(todo) == 1 else "repositories"
    say(f"{len(todo)} {many} graded as jobs in {time.monotonic() - started:.0f} s")
    return outcomes


def _time_anchors(
    jobs: ClassJobs, seen: dict[str, str], threads: int | None, say: Callable[[str], None]
) -> None:
    """One anchors job per GPU model that ran students, on a node that ran it (``anchors/gpu<i>.json``,
    what the class report reads); an earlier run's anchors, perhaps of other models, are removed."""
    folder = jobs.out / "anchors"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("gpu*"):
        stale.unlink()
    local = jobs.config.resolved_kind() == "local"
    for i, (model, host) in enumerate(sorted(seen.items())):
        config = dataclasses.replace(
            jobs.config,
            gpus_per_job=max(1, jobs.config.gpus_per_job),
            parallelism=1,
            slurm_params={**jobs.config.slurm_params, "nodelist": host},
        )
        call = ProcessJob(
            f"anchors {model}",
            anchor_command(folder / f"gpu{i}.json"),
            jobs.out,
            folder,
            folder / f"gpu{i}.log",
            config.time_min * 60 - 30,
            threads,
            jobs.local_gpus if local else 0,
            1,
        )
        say(f"[anchors] timing the suite's kernel and cuDNN on {model} ({host})")
        (end,) = run_jobs(config, {model: call}, log=say).values()
        if end.error is not None or end.result["code"] != 0:
            say(f"[anchors] {model}: failed ({end.error or end.result['code']}); see {folder}/gpu{i}.log")


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
