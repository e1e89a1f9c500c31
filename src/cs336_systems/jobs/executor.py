"""Running work as jobs, on one machine or on Slurm, through submitit.

One typed configuration (:class:`ExecutorConfig`) is shared by every command that submits jobs (the
bench sweep, the class run); it builds submitit's ``AutoExecutor`` for Slurm or its ``LocalExecutor`` for
one machine, so CI runs the same code path as a cluster: job folders, pickled calls and results, logs
and states all come from submitit. ``jobs/run.py`` submits a list of calls and watches them to the end.

A job's time: submitit asks Slurm for a warning (USR2) ``signal_lead_s`` before the limit, fitted to the
limit, and the suite's own limit on the job's work (``work_limit_s``) ends it before that warning can
come, so that a job that runs too long ends with the suite's one-line reason.

Standard library and submitit only: the commands import it before torch.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import submitit
from submitit.local.local import LocalJob

KINDS = ("local", "slurm", "auto")
SIGNAL_LEAD_MAX_S = 90  # submitit's default lead of its USR2 before the limit, kept for long limits
SIGNAL_LEAD_SHARE = 8  # shorter limits: an eighth of the limit (90 s before a 1-min limit ended it at once)
# slurmctld looks at time limits every 30 s, so its warning comes up to 30 s before its lead: asked for
# 15 s before a 1- and a 2-min limit, it came 27 and 29 s before (Slurm 22.05).
SLURM_TICK_S = 30
START_S = 10  # a job's start (srun, the interpreter, unpickling its call) before the call's clock starts


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

    def limit_s(self) -> int:
        return self.time_min * 60

    def signal_lead_s(self) -> int:
        """How long before the limit submitit's USR2 is asked for (``--signal=USR2@lead``): submitit
        ends a job that gets it late in its time ("timed-out too many times")."""
        return min(SIGNAL_LEAD_MAX_S, max(5, self.limit_s() // SIGNAL_LEAD_SHARE))

    def work_limit_s(self) -> int:
        """The suite's own limit on a job's work (pytest, the grading process), from the start of the
        job's call: over before Slurm's warning can come, it is what ends a job that runs too long."""
        return max(5, self.limit_s() - self.signal_lead_s() - SLURM_TICK_S - START_S)

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
        executor = SessionLocalExecutor(folder=config.folder, max_num_timeout=0)
        executor.update_parameters(**common, signal_delay_s=config.signal_lead_s())
        return executor
    executor = submitit.AutoExecutor(folder=config.folder, cluster="slurm", slurm_max_num_timeout=0)
    slurm: dict[str, Any] = {"slurm_array_parallelism": config.parallelism, "tasks_per_node": 1}
    slurm["slurm_signal_delay_s"] = config.signal_lead_s()
    if config.partition:
        slurm["slurm_partition"] = config.partition
    if config.cpus_per_job:
        slurm["cpus_per_task"] = config.cpus_per_job
    if config.slurm_params:
        slurm["slurm_additional_parameters"] = dict(config.slurm_params)
    executor.update_parameters(**common, **slurm)
    return executor


class SessionLocalExecutor(submitit.LocalExecutor):
    """submitit's ``LocalExecutor`` with each job's controller in a session of its own (submitit 1.5's
    ``start_controller``, as it is but for that, and without its ``setup`` and ``visible_gpus``, which
    nothing here uses): a Ctrl-C at the terminal reaches the submitting command alone, which cancels its
    jobs in order, instead of every controller and pytest at once, each printing its own
    KeyboardInterrupt traceback. A job's ``job_id`` is its controller's pid and process group."""

    def _submit_command(self, command: str) -> LocalJob:
        ntasks = self.parameters.get("tasks_per_node", 1)
        env = dict(
            os.environ,
            SUBMITIT_LOCAL_NTASKS=str(ntasks),
            SUBMITIT_LOCAL_COMMAND=command,
            SUBMITIT_LOCAL_TIMEOUT_S=str(int(60 * self.parameters.get("timeout_min", 2.0))),
            SUBMITIT_LOCAL_SIGNAL_DELAY_S=str(int(self.parameters.get("signal_delay_s", 30))),
            SUBMITIT_LOCAL_NODEID="0",
            SUBMITIT_LOCAL_JOB_NUM_NODES="1",
            SUBMITIT_STDERR_TO_STDOUT="",
            SUBMITIT_EXECUTOR="local",
            CUDA_VISIBLE_DEVICES=",".join(map(str, range(self.parameters.get("gpus_per_node", 0)))),
            SUBMITIT_LOCAL_WITH_SHELL="",
        )
        cmd = [sys.executable, "-m", "submitit.local._local", str(self.folder)]
        process = subprocess.Popen(cmd, env=env, start_new_session=True)
        return LocalJob(self.folder, str(process.pid), tasks=list(range(ntasks)), process=process)


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


def describe(config: ExecutorConfig, keys: Sequence[str], work_s: float | None = None) -> str:
    """One line: how many jobs go where, and their time (``work_s``: the work's own limit, where the
    caller's is shorter than the job's)."""
    kind = config.resolved_kind()
    where = (
        f"Slurm{f' partition {config.partition}' if config.partition else ''}"
        if kind == "slurm"
        else "this machine"
    )
    work = min(work_s or config.work_limit_s(), config.work_limit_s())
    limits = f"each {config.time_min} min, its work stopped at {work:.0f} s"
    return (
        f"{len(keys)} job(s) on {where}, {config.parallelism} at a time ({limits}), logs in {config.folder}"
    )
