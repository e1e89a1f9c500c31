"""Interruptions of a run of jobs, seen from both sides.

The submitting side (a sweep, a class): SIGINT (Ctrl-C) and SIGTERM (``kill``) are caught while its jobs
run (:func:`catching_stops`), so that it cancels them, keeps what ended, and exits with one line
(:class:`Interrupted`, exit 130 or 143). Uncaught, each process that got the signal printed its own
KeyboardInterrupt traceback, the statuses of finished jobs were never written, and a ``kill`` left the
running jobs to PID 1.

The job's side (:func:`work_ends_with_job`): SIGTERM (the sweep's cancel, forwarded by submitit's local
controller; ``scancel``; Slurm's end of the time limit) kills what the job's call started and ends the job
at once, writing no result. submitit's own handler ignores SIGTERM, so that Slurm can requeue a
preempted job (a result written then would read as the job's end); that left pytest or the grading
process running until a SIGKILL, or orphaned. The scheduler's state, or the parent that cancelled the
job, says why it ended. :class:`JobTimeout` is what a job's call raises when the suite's own time limit
stopped its work.

Standard library only: the commands import it before torch.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class JobTimeout(RuntimeError):
    """Raised by a job's call whose work the suite's own time limit stopped (its outcome: timed out)."""


class Interrupted(Exception):
    """SIGINT or SIGTERM arrived while jobs ran: those running were cancelled, those ended are kept."""

    def __init__(self, signum: int, kept: int = 0, cancelled: int = 0, not_started: int = 0) -> None:
        self.signum, self.kept, self.cancelled, self.not_started = signum, kept, cancelled, not_started
        super().__init__(f"interrupted by {self.name}")

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    @property
    def exit_code(self) -> int:
        """The shell's status for a process ended by the signal: 130 for SIGINT, 143 for SIGTERM."""
        return 128 + self.signum

    def line(self, what: str) -> str:
        """One line for the user: what was kept, what was cancelled, what to do next."""
        left = f", {self.not_started} not started" if self.not_started else ""
        return (
            f"interrupted by {self.name}: {self.kept} {what} ended and kept, {self.cancelled} cancelled{left};"
            " rerun the same command to run the rest"
        )


class Stops:
    """The first stop signal caught since :func:`catching_stops` began (``signum``; ``None``: none)."""

    def __init__(self) -> None:
        self.signum: int | None = None

    def _catch(self, signum: int, frame: object) -> None:
        if self.signum is None:  # a second Ctrl-C while the jobs are cancelled changes nothing
            self.signum = signum

    def sleep(self, seconds: float) -> bool:
        """Sleep up to ``seconds``, less once a stop signal is caught; whether one was. A handler that
        only records the signal lets ``time.sleep`` run its whole length (PEP 475), hence the steps."""
        deadline = time.monotonic() + seconds
        while self.signum is None and (left := deadline - time.monotonic()) > 0:
            time.sleep(min(0.1, left))
        return self.signum is not None


@contextlib.contextmanager
def catching_stops() -> Iterator[Stops]:
    """SIGINT and SIGTERM recorded instead of raised while the block runs (signals reach the main thread
    only: elsewhere nothing is caught, and the caller stops the block its own way)."""
    stops = Stops()
    if threading.current_thread() is not threading.main_thread():
        yield stops
        return
    previous = {s: signal.signal(s, stops._catch) for s in STOP_SIGNALS}
    try:
        yield stops
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


@contextlib.contextmanager
def work_ends_with_job() -> Iterator[None]:
    """Inside a job's call: SIGTERM kills every process the call started and ends the job at once (see
    the module's docstring). Main thread only (a call run from another thread, as in a test, is left
    as it is)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def end(signum: int, frame: object) -> None:
        kill_tree(os.getpid())
        _reap_children(timeout_s=5.0)  # not left as zombies to an init that may not reap them
        os._exit(128 + signum)

    previous = signal.signal(signal.SIGTERM, end)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def descendants(root: int) -> list[int]:
    """Every living descendant of ``root``, read from ``/proc``'s parent links."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]  # the name may hold spaces and ')'
        if state != "Z":
            children.setdefault(int(ppid), []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _reap_children(timeout_s: float) -> None:
    """Wait for this process's children to end (after they were killed), ``timeout_s`` at most."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:  # none left
            return
        if pid == 0:
            time.sleep(0.02)


def kill_tree(root: int, include_root: bool = False) -> None:
    """SIGKILL every descendant of ``root`` (and ``root`` itself with ``include_root``). The pids are read
    before any is killed, so a process whose parent dies first is still found."""
    for pid in [*descendants(root), *([root] if include_root else [])]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
