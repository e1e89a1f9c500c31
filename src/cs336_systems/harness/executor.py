"""Running work as jobs, on one machine or on Slurm, through submitit.

One typed configuration (:class:`ExecutorConfig`) is shared by every command that submits jobs (the
bench sweep, the class run); it builds submitit's ``AutoExecutor`` for Slurm or its ``LocalExecutor`` for
one machine, so CI runs the same code path as a cluster: job folders, pickled calls and results, logs
and states all come from submitit. :func:`run_jobs` submits a list of calls and watches them to the end,
telling each change of the pending / running / done / failed counts.

Standard library and submitit only: the commands import it before torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import submitit

KINDS = ("local", "slurm", "auto")
# submitit's and Slurm's spellings of states that have not started yet; everything else not finished
# counts as running.
PENDING_STATES = {"PENDING", "REQUEUED", "CONFIGURING", "RESV_DEL_HOLD", "REQUEUE_HOLD", "QUEUED"}


class ExecutorError(ValueError):
    """A configuration that cannot run (one line naming the problem)."""


@dataclass(frozen=True)
class ExecutorConfig:
    """Where and how jobs run. ``parallelism`` caps the jobs running at once (a Slurm array's ``%N``;
    on one machine, how many run side by side). ``slurm_params`` are passed to ``sbatch`` as they are
    (``--slurm-param KEY=VALUE``: ``#SBATCH --KEY=VALUE``)."""

    kind: str = "auto"
    folder: Path = Path("runs/jobs")
    partition: str | None = None
    gpus_per_job: int = 0
    cpus_per_job: int | None = None
    time_min: int = 60
    parallelism: int = 1
    slurm_params: Mapping[str, str] = field(default_factory=dict)
    poll_s: float | None = None  # None: 0.5 s on one machine, 2 s on Slurm (see ``poll_interval``)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ExecutorError(f"--executor {self.kind!r}: expected one of {', '.join(KINDS)}")
        for name in ("time_min", "parallelism"):
            if getattr(self, name) < 1:
                raise ExecutorError(
                    f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}"
                )
        if self.gpus_per_job < 0:
            raise ExecutorError(f"--gpus-per-job must be 0 or more, got {self.gpus_per_job}")

    def poll_interval(self) -> float:
        """Seconds between two looks at the jobs. On one machine a look is a ``poll()`` of each job's
        process, and a job that ended is only seen (and the next one started) at the next look: 2 s
        made a class of three 3-4 s slower than the one-machine scheduler's 0.5 s. On Slurm each look
        is one ``sacct``."""
        if self.poll_s is not None:
            return self.poll_s
        return 2.0 if self.resolved_kind() == "slurm" else 0.5

    def resolved_kind(self) -> str:
        """``local`` or ``slurm``: ``auto`` is Slurm where ``sbatch`` is on the PATH."""
        if self.kind == "auto":
            return "slurm" if shutil.which("sbatch") else "local"
        if self.kind == "slurm" and not shutil.which("sbatch"):
            raise ExecutorError("--executor slurm: no sbatch on the PATH (is Slurm installed here?)")
        return self.kind


def add_executor_options(parser: argparse.ArgumentParser, default_folder: str | None = None) -> None:
    """The executor options every submitting command takes."""
    group = parser.add_argument_group("where the jobs run (submitit)")
    group.add_argument("--executor", choices=KINDS, default="auto", help="auto: slurm where sbatch exists")
    group.add_argument("--partition", default=None, help="Slurm partition (sbatch --partition)")
    group.add_argument("--gpus-per-job", type=int, default=0, help="GPUs each job gets")
    group.add_argument("--cpus-per-job", type=int, default=None, help="CPUs each job gets (Slurm)")
    group.add_argument("--time-min", type=int, default=60, help="time limit of each job, minutes")
    group.add_argument("--parallelism", type=int, default=1, help="jobs running at once")
    group.add_argument(
        "--slurm-param",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra sbatch parameter, passed through (repeatable), e.g. --slurm-param account=cs336",
    )
    group.add_argument("--job-folder", default=default_folder, help="submitit's job folder (logs, pickles)")


def config_from_args(args: argparse.Namespace, default_folder: Path) -> ExecutorConfig:
    """The configuration the options of :func:`add_executor_options` name."""
    params = {}
    for item in args.slurm_param:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ExecutorError(f"--slurm-param expects KEY=VALUE, got {item!r}")
        params[key.strip().lstrip("-")] = value
    return ExecutorConfig(
        kind=args.executor,
        folder=Path(args.job_folder) if args.job_folder else default_folder,
        partition=args.partition,
        gpus_per_job=args.gpus_per_job,
        cpus_per_job=args.cpus_per_job,
        time_min=args.time_min,
        parallelism=args.parallelism,
        slurm_params=params,
    )


def make_executor(config: ExecutorConfig) -> submitit.Executor:
    """submitit's executor for ``config``. A job that runs out of time is not requeued (it fails, with
    its error); a preempted one is, when its call is ``submitit.helpers.Checkpointable``."""
    kind = config.resolved_kind()
    common: dict[str, Any] = {"timeout_min": config.time_min, "gpus_per_node": config.gpus_per_job}
    if kind == "local":
        executor = submitit.LocalExecutor(folder=config.folder, max_num_timeout=0)
        executor.update_parameters(**common)
        return executor
    executor = submitit.AutoExecutor(folder=config.folder, cluster="slurm", slurm_max_num_timeout=0)
    slurm: dict[str, Any] = {"slurm_array_parallelism": config.parallelism, "tasks_per_node": 1}
    if config.partition:
        slurm["slurm_partition"] = config.partition
    if config.cpus_per_job:
        slurm["cpus_per_task"] = config.cpus_per_job
    if config.slurm_params:
        slurm["slurm_additional_parameters"] = dict(config.slurm_params)
    executor.update_parameters(**common, **slurm)
    return executor


class GpuClaimError(RuntimeError):
    """A local job asked for more GPUs than the machine has."""


@contextlib.contextmanager
def claim_gpus(folder: Path, total: int, wanted: int, poll_s: float = 1.0) -> Iterator[list[int]]:
    """``wanted`` of this machine's ``total`` GPUs no other job holds (waits for them): an exclusive
    lock on ``folder/gpu<i>.lock`` each, held until the block ends or the process dies."""
    if wanted > total:
        raise GpuClaimError(f"--gpus-per-job {wanted}: this machine has {total} GPU(s)")
    folder.mkdir(parents=True, exist_ok=True)
    held: dict[int, IO[str]] = {}
    try:
        while len(held) < wanted:
            for i in range(total):
                if i in held or len(held) == wanted:
                    continue
                f = (folder / f"gpu{i}.lock").open("w")
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    held[i] = f
                except BlockingIOError:
                    f.close()
            if len(held) < wanted:
                time.sleep(poll_s)
        yield sorted(held)
    finally:
        for f in held.values():
            f.close()


def visible_devices(indices: Sequence[int], environ: Mapping[str, str] = os.environ) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child shown the GPUs at ``indices`` of those this process sees. A
    child reads the variable afresh, not relative to its parent's: under ``CUDA_VISIBLE_DEVICES=2,3``
    index 0 is GPU 2, and a child told "0" would time on GPU 0, another user's."""
    if "CUDA_VISIBLE_DEVICES" not in environ:
        return ",".join(map(str, indices))
    seen = [d.strip() for d in environ["CUDA_VISIBLE_DEVICES"].split(",") if d.strip()]
    return ",".join(seen[i] for i in indices)


@dataclass(frozen=True)
class LocalGpus:
    """One machine's GPUs, shared by the jobs that run side by side on it (submitit's ``LocalExecutor``
    shows every job the same first GPUs): each job claims ``per_job`` of ``devices`` through lock files in
    ``lock_dir``. ``devices`` are named as the submitting process sees them (:meth:`seen`): inside a job,
    ``CUDA_VISIBLE_DEVICES`` is submitit's ("0", "0,1"...), not the user's."""

    lock_dir: Path
    devices: tuple[str, ...]
    per_job: int

    @classmethod
    def seen(cls, lock_dir: Path, total: int, per_job: int) -> LocalGpus:
        """The ``total`` GPUs this process sees, named for a child's ``CUDA_VISIBLE_DEVICES``."""
        return cls(lock_dir, tuple(visible_devices(range(total)).split(",")) if total else (), per_job)

    @property
    def total(self) -> int:
        return len(self.devices)

    @contextlib.contextmanager
    def claim(self) -> Iterator[str]:
        """``CUDA_VISIBLE_DEVICES`` naming ``per_job`` GPUs no other job holds, held until the block ends."""
        with claim_gpus(self.lock_dir, self.total, self.per_job) as held:
            yield ",".join(self.devices[i] for i in held)


def gpu_claim(local: LocalGpus | None) -> contextlib.AbstractContextManager[str | None]:
    """``local``'s claim, or ``None`` (the GPUs the scheduler gave) where the jobs do not share a machine's."""
    return local.claim() if local else contextlib.nullcontext(None)


def local_gpu_count() -> int:
    """This machine's GPUs without importing torch: ``CUDA_VISIBLE_DEVICES`` where set, else
    ``nvidia-smi -L``'s lines (0 where there is no ``nvidia-smi``)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    if shutil.which("nvidia-smi") is None:
        return 0
    listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    return (
        sum(line.startswith("GPU ") for line in listed.stdout.splitlines()) if listed.returncode == 0 else 0
    )


@dataclass
class Outcome:
    """How one job ended: its result, or its error as text (a failed, cancelled or timed-out job)."""

    job_id: str
    state: str
    result: Any = None
    error: str | None = None


def job_phase(job: submitit.Job) -> str:
    """``pending``, ``running``, ``done`` or ``failed``."""
    if job.done():
        return "failed" if job.exception() is not None else "done"
    return "pending" if job.state.upper().split()[0] in PENDING_STATES else "running"


def _outcome(job: submitit.Job) -> Outcome:
    exc = job.exception()
    if exc is None:
        return Outcome(job.job_id, "done", result=job.result())
    return Outcome(job.job_id, "failed", error=f"{job.state}: {job_error(str(exc))}")


LOGS_NOTE = "You can check full logs"  # where submitit's message turns from the error to its log paths


def job_error(message: str) -> str:
    """One line from submitit's message on a failed job: the error's own last line (a traceback's
    exception, or the last line of a killed job's stderr), and the job's error log. The message ends
    with the log paths, so its last lines alone named only where to look."""
    body, _, logs = message.partition(LOGS_NOTE)
    lines = [line.strip() for line in body.splitlines() if line.strip().strip("-")]
    error = lines[-1][-600:] if lines else "no error message"
    paths = [line.strip(" -") for line in logs.splitlines() if line.strip().endswith(".err")]
    return error + (f" (log: {paths[0]})" if paths else "")


def run_jobs(
    config: ExecutorConfig,
    calls: Mapping[str, Callable[[], Any]],
    on_submit: Callable[[str, str], None] = lambda key, job_id: None,
    log: Callable[[str], None] = print,
) -> dict[str, Outcome]:
    """Run every call of ``calls`` as a job and wait for all of them; the outcome of each, by key.

    On Slurm every call is submitted at once, as one array limited to ``parallelism`` running tasks; on
    one machine at most ``parallelism`` run at a time (submitit's LocalExecutor starts each at once).
    ``on_submit(key, job_id)`` is told each job id as it is known (for a rerun to find them)."""
    executor = make_executor(config)
    keys = list(calls)
    jobs: dict[str, submitit.Job] = {}
    waiting = list(keys)
    if config.resolved_kind() == "slurm":
        with executor.batch():
            submitted = [executor.submit(calls[k]) for k in keys]
        jobs = dict(zip(keys, submitted, strict=True))
        waiting = []
        for key, job in jobs.items():
            on_submit(key, job.job_id)
    outcomes: dict[str, Outcome] = {}
    poll = config.poll_interval()
    vanished = _Vanished(grace_s=max(30.0, 5 * poll))
    last = ""
    while len(outcomes) < len(keys):
        running = [k for k in jobs if k not in outcomes]
        while waiting and len(running) < config.parallelism:
            key = waiting.pop(0)
            jobs[key] = executor.submit(calls[key])
            on_submit(key, jobs[key].job_id)
            running.append(key)
        counts = {"pending": len(waiting), "running": 0, "done": 0, "failed": 0}
        _refresh_states(jobs.values())
        for key, job in jobs.items():
            if key not in outcomes and job.done():
                outcomes[key] = _outcome(job)
            elif key not in outcomes and vanished.gone(job):
                error = "left the queue with no result and no accounting record (cancelled while pending?)"
                outcomes[key] = Outcome(job.job_id, "failed", error=f"UNKNOWN: {error}")
            counts[outcomes[key].state if key in outcomes else job_phase(job)] += 1
        line = " ".join(f"{n} {name}" for name, n in counts.items())
        if line != last:
            log(f"jobs: {line}")
            last = line
        if len(outcomes) < len(keys):
            time.sleep(poll)
    return outcomes


def _refresh_states(jobs: Iterable[submitit.Job]) -> None:
    """One state query (``sacct``) for every job, each poll: submitit's own cadence for Slurm waits up to
    minutes between queries, and a job killed before writing its result is known only from its state."""
    job = next(iter(jobs), None)
    if isinstance(job, submitit.SlurmJob):
        job.watcher.update()


class _Vanished:
    """Slurm jobs that are neither queued nor accounted for. ``sacct`` has no line for an array task
    cancelled while pending (seen with slurmdbd 22.05), so submitit calls it UNKNOWN forever; such a job
    is failed once ``squeue`` has not known it for ``grace_s`` (accounting can lag a finished job)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.since: dict[str, float] = {}

    def gone(self, job: submitit.Job) -> bool:
        if not isinstance(job, submitit.SlurmJob) or job.state.upper() != "UNKNOWN":
            return False
        queued = subprocess.run(
            ["squeue", "-h", "-j", job.job_id], capture_output=True, text=True, timeout=60
        )
        if queued.returncode == 0 and queued.stdout.strip():
            self.since.pop(job.job_id, None)
            return False
        first = self.since.setdefault(job.job_id, time.monotonic())
        return time.monotonic() - first > self.grace_s


def describe(config: ExecutorConfig, keys: Sequence[str]) -> str:
    """One line: how many jobs go where."""
    kind = config.resolved_kind()
    where = (
        f"Slurm{f' partition {config.partition}' if config.partition else ''}"
        if kind == "slurm"
        else "this machine"
    )
    return f"{len(keys)} job(s) on {where}, {config.parallelism} at a time, logs in {config.folder}"
