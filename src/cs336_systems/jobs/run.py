"""Running calls as jobs and watching them to the end (:func:`run_jobs`), through the executor that
``jobs/executor.py`` builds.

What the caller hears, through a :class:`Watch`: each job's id as it is submitted, each job's outcome as
soon as it ends (so that a run stopped half-way has recorded what finished), each running job at every
look (for its own progress lines), and a line whenever the counts of pending / running / done / failed
(and cancelled, timed-out) jobs change. SIGINT or SIGTERM cancels the jobs still running, records them as
cancelled, and raises :class:`~.interrupt.Interrupted`.

Standard library and submitit only: the commands import it before torch.
"""

from __future__ import annotations

import contextlib
import io
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import submitit
from submitit.core.utils import FailedJobError, FailedSubmissionError

from .executor import ExecutorConfig, ExecutorError, make_executor
from .interrupt import Interrupted, JobTimeout, catching_stops, kill_tree

# submitit's and Slurm's spellings of states that have not started yet; UNKNOWN is a job sacct has no
# line for yet (just submitted). Everything else not ended counts as running.
PENDING_STATES = {"PENDING", "REQUEUED", "CONFIGURING", "RESV_DEL_HOLD", "REQUEUE_HOLD", "QUEUED", "UNKNOWN"}
COUNTED = ("pending", "running", "done", "failed")  # always in the counts line; other states once seen
CANCEL_GRACE_S = 10.0  # a local job's time to end its work on SIGTERM before its whole tree is killed
VANISHED = "left the queue with no result and no accounting record (cancelled while pending?)"


@dataclass
class Outcome:
    """How one job ended (``state``: done, failed, cancelled or timed out): its result, or its error as
    one line."""

    job_id: str
    state: str
    result: Any = None
    error: str | None = None


def _ignore(*args: object) -> None:
    return None


@dataclass(frozen=True)
class Watch:
    """What :func:`run_jobs` tells its caller, from its loop: ``submitted(key, job_id)``;
    ``ended(key, outcome)`` as each job ends, or is cancelled; ``running(key, seconds)`` for each running
    job at each look, with the seconds since it was first seen running; ``log(line)``, the counts."""

    submitted: Callable[[str, str], None] = _ignore
    ended: Callable[[str, Outcome], None] = _ignore
    running: Callable[[str, float], None] = _ignore
    log: Callable[[str], None] = print


def job_phase(job: submitit.Job, queued: str | None = None) -> str:
    """``pending`` or ``running``, for a job whose end has not been recorded yet (``queued``: squeue's
    state, for a job sacct has no line for yet)."""
    words = str(queued or job.state).upper().split()
    return "pending" if (words[0] if words else "UNKNOWN") in PENDING_STATES else "running"


def job_outcome(job: submitit.Job) -> Outcome:
    """A job that ended: done with its result, or its error as one line; a Slurm job cancelled or
    killed at its time limit is named so, and so is a call the suite's own limit stopped."""
    exc = job.exception()
    if exc is None:
        return Outcome(job.job_id, "done", result=job.result())
    error, state = job_error(str(exc)), str(job.state)
    mark = f"{JobTimeout.__name__}: "
    if mark in error:
        return Outcome(job.job_id, "timed out", error=error.split(mark, 1)[1])
    first = (state.upper().split() or [""])[0]
    named = {"CANCELLED": "cancelled", "TIMEOUT": "timed out"}.get(first, "failed")
    return Outcome(job.job_id, named, error=f"{state}: {error}")


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
    config: ExecutorConfig, calls: Mapping[str, Callable[[], Any]], watch: Watch | None = None
) -> dict[str, Outcome]:
    """Run every call of ``calls`` as a job and wait for all of them; the outcome of each, by key.

    On Slurm every call is submitted at once, as one array limited to ``parallelism`` running tasks; on
    one machine at most ``parallelism`` run at a time (submitit's LocalExecutor starts each at once).
    SIGINT or SIGTERM: the jobs still running are cancelled (each told to ``watch.ended`` as cancelled)
    and :class:`~.interrupt.Interrupted` is raised."""
    run = _Run(config, calls, watch or Watch())
    with catching_stops() as stops:
        run.submit()
        run.tell()
        while len(run.outcomes) < len(calls):
            if stops.sleep(run.poll_s):
                raise run.interrupt(stops.signum or signal.SIGINT)
            run.look()
            run.submit()  # before counting: a job that ended and the next one started are one change
            run.tell()
    return run.outcomes


class _Run:
    """The jobs of one :func:`run_jobs` call: those waiting (one machine), submitted, and ended."""

    def __init__(self, config: ExecutorConfig, calls: Mapping[str, Callable[[], Any]], watch: Watch):
        self.config, self.calls, self.watch = config, calls, watch
        self.executor = make_executor(config)
        self.slurm = config.resolved_kind() == "slurm"
        self.waiting = list(calls)
        self.jobs: dict[str, submitit.Job] = {}
        self.outcomes: dict[str, Outcome] = {}
        self.running_since: dict[str, float] = {}
        self.poll_s = config.poll_interval()
        self.queue = _Queue(grace_s=max(30.0, 5 * self.poll_s))
        self.last = ""

    def live(self) -> dict[str, submitit.Job]:
        return {k: j for k, j in self.jobs.items() if k not in self.outcomes}

    def submit(self) -> None:
        """Slurm: every waiting call at once, as one array; one machine: up to ``parallelism`` running."""
        if self.slurm and self.waiting:
            keys, self.waiting = self.waiting, []
            with refused_by_sbatch(self.config), self.executor.batch():
                submitted = [self.executor.submit(self.calls[k]) for k in keys]
            for key, job in zip(keys, submitted, strict=True):
                self.jobs[key] = job
                self.watch.submitted(key, job.job_id)
        while self.waiting and len(self.live()) < self.config.parallelism:
            key = self.waiting.pop(0)
            self.jobs[key] = self.executor.submit(self.calls[key])
            self.watch.submitted(key, self.jobs[key].job_id)

    def look(self) -> None:
        live = self.live()
        _refresh_states(live.values())
        self.queue.update(live.values())
        for key, job in live.items():
            if job.done():
                self._end(key, job_outcome(job))
            elif self.queue.gone(job):
                self._end(key, Outcome(job.job_id, "failed", error=f"UNKNOWN: {VANISHED}"))
            elif self._phase(job) == "running":
                since = self.running_since.setdefault(key, time.monotonic())
                self.watch.running(key, time.monotonic() - since)

    def _phase(self, job: submitit.Job) -> str:
        return job_phase(job, self.queue.states.get(job.job_id))

    def _end(self, key: str, outcome: Outcome) -> None:
        self.outcomes[key] = outcome
        self.watch.ended(key, outcome)

    def tell(self) -> None:
        counts = dict.fromkeys(COUNTED, 0)
        counts["pending"] = len(self.waiting)
        for key, job in self.jobs.items():
            state = self.outcomes[key].state if key in self.outcomes else self._phase(job)
            counts[state] = counts.get(state, 0) + 1
        line = " ".join(f"{n} {name}" for name, n in counts.items() if n or name in COUNTED)
        if line != self.last:
            self.watch.log(f"jobs: {line}")
            self.last = line

    def interrupt(self, signum: int) -> Interrupted:
        """Cancel the jobs still running; each that ended meanwhile keeps its own outcome."""
        live = self.live()
        _cancel(live.values(), self.slurm)
        why = f"the run was interrupted by {signal.Signals(signum).name}"
        for key, job in live.items():
            ended = job.paths.result_pickle.exists()
            self._end(key, job_outcome(job) if ended else Outcome(job.job_id, "cancelled", error=why))
        self.tell()
        cancelled = sum(self.outcomes[k].error == why for k in live)
        return Interrupted(signum, len(self.outcomes) - cancelled, cancelled, len(self.waiting))


def _cancel(jobs: Iterable[submitit.Job], slurm: bool) -> None:
    """On Slurm, one ``scancel``. On one machine, SIGTERM to each job's controller, which hands it to
    the job's call (:func:`~.interrupt.work_ends_with_job` ends its work); a job still there after
    ``CANCEL_GRACE_S`` (its call had not started yet) is killed with its whole tree."""
    jobs = list(jobs)
    if slurm:
        if jobs:
            subprocess.run(["scancel", *(j.job_id for j in jobs)], capture_output=True, timeout=60)
        return
    for job in jobs:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(job.job_id), signal.SIGTERM)
    deadline = time.monotonic() + CANCEL_GRACE_S
    while not all(job.done() for job in jobs) and time.monotonic() < deadline:
        time.sleep(0.1)
    for job in jobs:
        if not job.done():
            kill_tree(int(job.job_id), include_root=True)
    while not all(job.done() for job in jobs):  # reaps the controllers
        time.sleep(0.05)


@contextlib.contextmanager
def refused_by_sbatch(config: ExecutorConfig) -> Iterator[None]:
    """sbatch's refusal (an unknown partition, a GRES no node has) as an :class:`ExecutorError` of one
    line, instead of submitit's traceback and sbatch's own lines printed before it."""
    said = io.StringIO()
    try:
        with contextlib.redirect_stderr(said):
            yield
    except (FailedJobError, FailedSubmissionError) as exc:
        raise ExecutorError(sbatch_refusal(config, str(exc) or said.getvalue())) from None


def sbatch_refusal(config: ExecutorConfig, message: str) -> str:
    """What sbatch refused, what was asked, and what this cluster offers (``sinfo``)."""
    errors = [line.split("error:", 1)[1].strip() for line in message.splitlines() if "error:" in line]
    reasons = [e for e in errors if not e.startswith("Batch job submission failed")] or errors
    reason = reasons[0] if reasons else (message.strip().splitlines() or ["no message"])[-1]
    asked = f"partition {config.partition or '(the default)'}, {config.gpus_per_job} GPU(s) per job"
    asked += "".join(f", --{k}={v}" for k, v in config.slurm_params.items())
    return (
        f"sbatch refused the jobs: {reason} (asked: {asked}); this cluster has {cluster_offer()} "
        "(`sinfo -o '%P %G'` lists the partitions and their GRES)"
    )


def cluster_offer() -> str:
    """The partitions and their generic resources, as ``sinfo`` lists them (``*``: the default)."""
    try:
        found = subprocess.run(["sinfo", "-h", "-o", "%P %G"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return "partitions sinfo could not list"
    pairs = sorted({tuple(line.split(maxsplit=1)) for line in found.stdout.splitlines() if line.strip()})
    shown = [f"{p[0]} ({'no GRES' if len(p) < 2 or p[1] == '(null)' else p[1]})" for p in pairs]
    return "partitions " + ", ".join(shown) if shown else "no partition sinfo lists"


def _refresh_states(jobs: Iterable[submitit.Job]) -> None:
    """One state query (``sacct``) for every job, each poll: submitit's own cadence for Slurm waits up to
    minutes between queries, and a job killed before writing its result is known only from its state."""
    job = next(iter(jobs), None)
    if isinstance(job, submitit.SlurmJob):
        job.watcher.update()


class _Queue:
    """What ``squeue`` says of the Slurm jobs ``sacct`` has no line for (submitit's UNKNOWN), in one call
    a look: a job just submitted, or just started (accounting lagged its start by tens of seconds here),
    or gone. ``sacct`` has no line for an array task cancelled while pending (seen with slurmdbd 22.05),
    so submitit calls it UNKNOWN forever; such a job is failed once ``squeue`` has not known it for
    ``grace_s`` (accounting can lag a finished job)."""

    def __init__(self, grace_s: float) -> None:
        self.grace_s = grace_s
        self.states: dict[str, str] = {}  # job id -> squeue's state, for the jobs sacct does not know
        self.since: dict[str, float] = {}  # job id -> when squeue first did not know it either

    def update(self, jobs: Iterable[submitit.Job]) -> None:
        unknown = [
            j.job_id for j in jobs if isinstance(j, submitit.SlurmJob) and j.state.upper() == "UNKNOWN"
        ]
        self.states = {}
        if unknown:
            command = ["squeue", "-h", "-r", "-o", "%i %T", "-j", ",".join(unknown)]
            listed = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
            self.states = dict(
                line.split(maxsplit=1) for line in listed.splitlines() if len(line.split()) == 2
            )
        now = time.monotonic()  # a job sacct or squeue knows again is no longer counted as gone
        self.since = {j: self.since.get(j, now) for j in unknown if j not in self.states}

    def gone(self, job: submitit.Job) -> bool:
        return time.monotonic() - self.since.get(job.job_id, time.monotonic()) > self.grace_s
