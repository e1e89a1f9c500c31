"""Starting grading workers, and collecting what they wrote as untrusted data.

A job runs one worker process per rank (``worker/__main__.py``, the student's roots first on its path)
in a folder this process makes: ``job.json`` (what to run, and a fresh token), ``inputs/<case>.pt`` (the
judge's inputs), ``out/`` (where each rank writes ``<name>.rank<r>.pt``). A rank that dies ends its peers
at once (they would wait on it), a job past its time limit is killed, and what the workers wrote is
read by name only (``exchange.read_payload``): a missing or malformed record, one without this job's
token, or a file nobody asked for is a problem of the case or of the job, never a pass. Exit codes are
read only to say why a record is missing. ``CaseRuns`` runs the selected cases of a family and world
size in one job (ranks cost seconds to start) and reruns alone each case a crash left without records.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from cs336_systems.distributed.launch import host_store

from ..exchange import Untrusted, read_payload, text
from ..limits import Limits
from ..roots import SUITE_PACKAGE, StudentRoots, grader_pythonpath, suite_paths
from ..sandbox import JobFolder, Sandbox, jobs_parent, returncode, walls_message

WORKER = Path(__file__).resolve().parents[1] / "worker" / "__main__.py"
JOB_STARTS, JOB_ENDED = "starts", "ended"  # ``CaseRuns.on_job``'s notes besides a rerun's reason
RUNS_ALONE = "alone: a crash left it without records"
EXIT_MEANING = {
    3: "the adapters file did not load",
    4: "refused to grade the suite's own code",
    5: "a case raised",
}


@dataclass
class Job:
    roots: StudentRoots
    task: str  # "cases", "load" or "timing.<function>"
    cases: list[str] = field(default_factory=list)
    inputs: dict[str, dict] = field(default_factory=dict)
    args: dict = field(default_factory=dict)
    world_size: int = 1
    timeout: float = field(default_factory=lambda: Limits().worker_s)  # callers pass their share
    backend: str = "gloo"
    # Run in this process while the workers run, given the job's folder and a check that they are all
    # still alive (the parent's clock talks to a timing worker this way); its return value is kept.
    conversation: Callable[[Path, Callable[[], bool]], Any] | None = None
    records: tuple[str, ...] = ()  # more records the workers write (``clock.<round>``)
    files: tuple[str, ...] = ()  # plain files the workers may leave in ``out/`` (``ready.<round>``)
    prefix: tuple[str, ...] = ()  # a command the worker runs under (an observer outside the process)
    prefix_writes: tuple[Path, ...] = ()  # the folders that command writes (the observer's report)
    sandbox: Sandbox = field(default_factory=Sandbox.from_env)

    def names(self) -> list[str]:
        base = {"cases": self.cases, "load": ["load"]}.get(self.task, ["timing"])
        return [*base, *self.records]


@dataclass(frozen=True)
class Machine:
    """How busy this machine is: a worker time limit reached while the load average is far above the
    cores (``overload`` times) says the machine could not finish the case, not that the code hangs.
    ``load`` is injectable (a test's stand-in)."""

    load: Callable[[], float] = field(default=lambda: os.getloadavg()[0])
    cores: int = field(default_factory=lambda: os.cpu_count() or 1)
    overload: float = 2.0

    def busy(self) -> str | None:
        """The load it saw, when it is far above the cores."""
        load = self.load()
        return f"load {load:.1f} on {self.cores} cores" if load > self.overload * self.cores else None


LOST_CONNECTION = ("Connection reset by peer", "Connection closed by peer")
STORE_GRACE_S = 60.0  # the store outlives the job's limit by the ranks' start and teardown


@dataclass
class Collected:
    """What a job left: each (name, rank)'s validated record, or why there is none (its exit code and
    last output line say why); a problem of the whole job (timed out, wrote files nobody asked for)."""

    records: dict[tuple[str, int], dict] = field(default_factory=dict)
    problems: dict[tuple[str, int], str] = field(default_factory=dict)
    job_problem: str | None = None
    conversation: Any = None  # what ``Job.conversation`` returned
    timed_out: bool = False
    walls_problem: str | None = None  # the sandbox could not be built: the code never ran

    def lost_connection(self) -> bool:
        """A rank lost to a connection reset (a peer's socket gone under it, not a wrong answer)."""
        said = [str(r.get("message", "")) for r in self.records.values()] + list(self.problems.values())
        return any(lost in line for line in said for lost in LOST_CONNECTION)


def _env(rank: int, world_size: int, port: int, task: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CS336_GRADE"))}
    env["PYTHONPATH"] = os.pathsep.join(grader_pythonpath(env))
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        PYTHONUNBUFFERED="1",
    )
    if world_size > 1:
        env["TORCHELASTIC_USE_AGENT_STORE"] = "True"  # the store is the runner's: every rank is a client
    if task == "cases":
        # The cases' CPU work is small operators, in ranks and jobs side by side: one thread each rather
        # than a thread per core in every one of them (timing workers keep the machine's setting).
        env["OMP_NUM_THREADS"] = "1"
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


NOISE = ("USDT:", "STAGE:", "SyncActivityProfilerHandler", "Kineto")  # torch.profiler's own log lines


def _tail(file: Path) -> str:
    lines = [
        line
        for line in file.read_text(errors="replace").splitlines()
        if line.strip() and not any(n in line for n in NOISE)
    ]
    return text(lines[-1].strip(), 400) if lines else "(no output)"


def _watch(procs: list[subprocess.Popen], timeout: float) -> bool:
    """Wait for every rank; on the first that exits non-zero, or past ``timeout``, kill the rest.
    Whether it timed out. Interrupted (Ctrl-C, the caller's own time limit: pytest-timeout raises in
    this thread), it kills every rank before the exception goes on: no rank outlives its job."""
    deadline = time.monotonic() + timeout
    try:
        while any(p.poll() is None for p in procs):
            bad = any(p.poll() not in (None, 0) for p in procs)
            late = time.monotonic() > deadline
            if bad or late:
                _kill(procs)
                return late and not bad
            time.sleep(0.05)
    except BaseException:
        _kill(procs)
        raise
    return False


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
    for p in procs:
        p.wait()


def run(job: Job) -> Collected:
    folder = JobFolder.make(jobs_parent())
    try:
        return _run_in(job, folder)
    finally:
        folder.remove()


def _run_in(job: Job, folder: JobFolder) -> Collected:
    token = secrets.token_hex(16)
    (folder.path / "inputs").mkdir()
    for case_id, inputs in job.inputs.items():
        torch.save(inputs, folder.path / "inputs" / f"{case_id}.pt")
    spec = {
        "token": token,
        "paths": job.roots.paths(),
        "suite_paths": suite_paths(),
        "dists": [{"name": k, "version": v} for k, v in job.roots.dists.items()],
        "adapters": str(job.roots.adapters),
        "forbidden": None if job.roots.self_grade else str(SUITE_PACKAGE),
        "roots": job.roots.paths(),
        "task": job.task,
        "cases": job.cases,
        "args": job.args,
        "backend": job.backend,
        "inputs": str(folder.path / "inputs"),
        "out": str(folder.out),
    }
    (folder.path / "job.json").write_text(json.dumps(spec))
    job.sandbox.prepare(folder)
    plain = [sys.executable, str(WORKER), str(folder.path / "job.json")]
    keep = [job.roots.adapters.parent, *job.roots.folders()]
    # The rendezvous store is the parent's, on a port the OS picks and kept bound for the whole job (as
    # distributed.launch does): a port found free here and bound later by rank 0 was, about one class run
    # in six, taken in between by another job's connection (EADDRINUSE), a failure of the machine that
    # read as the code's. A single process starts no group.
    store = host_store(job.world_size, job.timeout + STORE_GRACE_S) if job.world_size > 1 else None
    port = store.port if store is not None else 0
    observer = job.sandbox.observer(job.prefix, folder, keep, job.roots.repo_root, job.prefix_writes)
    procs, pipes = [], []
    for rank in range(job.world_size):
        read_end, write_end = os.pipe()  # the walls' "ok" (or why not), written before the code starts
        pipes.append(read_end)
        cmd = job.sandbox.wrap(plain, folder, keep, job.roots.repo_root, ready_fd=write_end)
        log = (folder.path / f"rank{rank}.log").open("w")
        procs.append(
            subprocess.Popen(
                [*observer, *cmd],
                cwd=job.roots.repo_root,
                env=_env(rank, job.world_size, port, job.task) | job.sandbox.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                pass_fds=(write_end,),
            )
        )
        os.close(write_end)
    talk = _Conversation(job, folder.path, procs) if job.conversation else None
    timed_out = _watch(procs, job.timeout)
    del store  # every rank is gone
    codes = [returncode(p.returncode, job.sandbox.uses_namespaces()) for p in procs]
    got = _collect(job, folder.path, token, codes, timed_out)
    said = [walls_message(r) for r in pipes]
    got.walls_problem = next((m for m in said if m is not None and m != "ok"), None)
    got.conversation = talk.result() if talk else None
    return got


class _Conversation(threading.Thread):
    """``Job.conversation`` in a thread beside ``_watch`` (which still ends the job on a dead rank or at
    its time limit); an exception it raises is its result, for the caller to report."""

    def __init__(self, job: Job, folder: Path, procs: list[subprocess.Popen]) -> None:
        super().__init__(daemon=True)
        self.job, self.folder, self.procs, self.value = job, folder, procs, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.job.conversation(self.folder, lambda: all(p.poll() is None for p in self.procs))
        except Exception as exc:
            self.value = exc

    def result(self) -> Any:
        self.join(timeout=60)
        return self.value


def _collect(job: Job, folder: Path, token: str, codes: list[int | None], timed_out: bool) -> Collected:
    got = Collected(timed_out=timed_out)
    optional = ["refused", "load"]  # written instead of the asked-for records when the job cannot start
    expected = {f"{n}.rank{r}.pt" for n in [*job.names(), *optional] for r in range(job.world_size)}
    expected |= set(job.files)
    extra = sorted(p.name for p in (folder / "out").iterdir() if p.name not in expected)
    if extra:
        got.job_problem = f"the graded process wrote files the grader did not ask for: {', '.join(extra[:5])}"
    elif timed_out:
        got.job_problem = f"timed out after {job.timeout:.0f} s"
    for name in dict.fromkeys([*job.names(), *optional]):
        for rank in range(job.world_size):
            path = folder / "out" / f"{name}.rank{rank}.pt"
            if name in optional and name not in job.names() and not path.exists():
                continue
            try:
                got.records[(name, rank)] = read_payload(path, token, name, rank)
            except Untrusted as exc:
                got.problems[(name, rank)] = _why_missing(str(exc), rank, codes[rank], folder, timed_out)
    return got


def _why_missing(problem: str, rank: int, code: int | None, folder: Path, timed_out: bool) -> str:
    if not problem.startswith("no output"):
        return problem
    if timed_out:
        return f"rank {rank} did not finish: the job timed out"
    if code in (-9, None):
        return f"rank {rank} was stopped after a peer failed"
    if code < 0:
        how = f"was killed by {signal.Signals(-code).name} before writing this case's outputs (a crash" + (
            ": an out-of-bounds access under Triton's interpreter is one cause)"
            if code == -signal.SIGSEGV
            else ")"
        )
    else:
        meaning = EXIT_MEANING.get(code, "a process that leaves in the middle of a case fails it")
        how = f"exited with code {code} before writing this case's outputs ({meaning})"
    return f"rank {rank} {how}; its last output: {_tail(folder / f'rank{rank}.log')}"


@dataclass
class Outcome:
    """A case's records from every rank (some may say the call raised), or why there are none;
    ``error`` names a problem of the grading rather than of the case (load, refused)."""

    records: list[dict] | None = None
    problem: str | None = None
    error: str | None = None
    unfinished: str | None = None  # why this machine could not finish it (left out of the score)

    def seconds(self) -> float | None:
        """How long the slowest rank said the case took (diagnostic: the graded process says it)."""
        return _slowest(self.records, "seconds")

    def began(self) -> float | None:
        """When the case began after its worker started (the first case of a job: the start's cost)."""
        return _slowest(self.records, "began_s")


def _slowest(records: list[dict] | None, key: str) -> float | None:
    times = [r[key] for r in records or () if isinstance(r.get(key), int | float)]
    return max(times) if times else None


@dataclass
class CaseRuns:
    """The outcome of each case, from jobs of the selected cases of one family and world size, each case
    rerun alone when a job left it without records. A job-wide refusal or load failure is every case's."""

    roots: StudentRoots
    timeout: float
    done: dict[str, Outcome] = field(default_factory=dict)
    machine: Machine = field(default_factory=Machine)
    # Told as each job starts, runs once more (the note says why) and ends (``JOB_ENDED``): the
    # judge's progress lines say what runs now.
    on_job: Callable[[list[str], int, str], None] = field(default=lambda batch, world_size, note: None)

    def outcome(self, case_id: str, batch: list[str], world_size: int, make_inputs: Any) -> Outcome:
        if case_id not in self.done:
            todo = [c for c in batch if c not in self.done] or [case_id]
            self._run(todo, world_size, make_inputs, retry_alone=len(todo) > 1)
        return self.done[case_id]

    def _run(
        self, batch: list[str], world_size: int, make_inputs: Any, retry_alone: bool, note: str = ""
    ) -> None:
        job = Job(
            self.roots,
            "cases",
            batch,
            {c: make_inputs(c) for c in batch},
            world_size=world_size,
            timeout=self.timeout,
        )
        self.on_job(batch, world_size, note or JOB_STARTS)
        try:
            got = self._run_twice(job)
        finally:
            self.on_job(batch, world_size, JOB_ENDED)
        if isinstance(got, str):
            for case_id in batch:
                self.done[case_id] = Outcome(unfinished=f"could not grade here: {got}")
            return
        whole = _job_wide(got)
        for case_id in batch:
            present = [got.records[(case_id, r)] for r in range(world_size) if (case_id, r) in got.records]
            if whole is not None:
                self.done[case_id] = whole
            elif len(present) == world_size or any(p.get("status") != "done" for p in present):
                # complete, or a rank that raised wrote its record and left (its peers were stopped)
                self.done[case_id] = Outcome(records=present)
            elif not retry_alone:
                problems = [
                    got.problems[(case_id, r)] for r in range(world_size) if (case_id, r) in got.problems
                ]
                self.done[case_id] = Outcome(problem=problems[0] if problems else "no output")
        for case_id in [c for c in batch if c not in self.done]:
            self._run([case_id], world_size, make_inputs, retry_alone=False, note=RUNS_ALONE)

    def _run_twice(self, job: Job) -> Collected | str:
        """The job's result; run once more when the machine may have been busy, or a connection reset,
        once only: why the machine could not finish it when the second run says so too."""
        got = run(job)
        if first := self._unfinished(got, again=False):
            self.on_job(job.cases, job.world_size, f"once more: {first}")
            got = run(job)
            if why := self._unfinished(got, again=True):
                return why
        return got

    def _unfinished(self, got: Collected, again: bool) -> str | None:
        """Why this machine, not the code, may have failed the job: its time limit reached under a load
        far above the cores, or a rank's connection reset (on a first run; ``again``, a reset is the
        machine's only on a busy machine). A time limit on an idle machine is the code's, and so is a
        reset that a quiet machine repeats: the words are the graded process's to print, and taking
        them at their word left any failing case out of the score. Walls that could not be built are
        the machine's: the code never ran (only the walls' own pipe says so)."""
        if got.walls_problem:
            return got.walls_problem
        if got.timed_out and (busy := self.machine.busy()):
            return f"{got.job_problem} at {busy}"
        if got.lost_connection():
            busy = self.machine.busy()
            if not again:
                return f"a rank lost its connection to its peers ({busy or 'once'})"
            return f"a rank lost its connection to its peers ({busy})" if busy else None
        return None


def _job_wide(got: Collected) -> Outcome | None:
    """Every case's outcome when the job as a whole failed: the adapters did not load, the guard
    refused, or the graded process wrote files nobody asked for / ran out of time."""
    for (name, _), record in got.records.items():
        if name == "load" and record.get("status") == "load-error":
            return Outcome(
                problem=text(record.get("message", "the adapters file did not load")), error="load"
            )
        if name == "refused":
            return Outcome(problem=text(record.get("message", "refused")), error="refused")
    return Outcome(problem=got.job_problem) if got.job_problem else None
