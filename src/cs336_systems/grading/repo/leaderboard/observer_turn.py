"""Observed runs of one machine take turns, and the time a repository waits for its turn is not its own.

Two Nsight Compute sessions side by side starve each other (one sees no kernel, the other waits past its
limit: docs/grading.md), so a repository's observed round takes an exclusive lock first. The lock is per
host: jobs of one class on other nodes of a cluster do not wait for each other. While a job waits, it keeps
a record in its own folder (``WAIT_FILE``), from which the class run adds the wait to that repository's
time limit: a repository is never stopped for time spent behind another's observation.

Standard library only: the class run's parent reads the record without torch.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import platform
import time
from collections.abc import Iterator
from pathlib import Path

WAIT_FILE = "observer_wait.json"


def lock_path(class_out: Path) -> Path:
    """The lock the observed runs of this host take in turn, in the class's output folder."""
    return class_out / f".observer-{platform.node() or 'host'}.lock"


@contextlib.contextmanager
def turn(lock: Path | None, record: Path | None = None) -> Iterator[None]:
    """Hold this host's observer lock for the block; while waiting for it, ``record`` says since when."""
    if lock is None:
        yield
        return
    before = waited_s(record.parent) if record else 0.0
    since = time.time()
    if record:
        record.write_text(json.dumps({"waited_s": before, "since": since}))
    with lock.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        if record:
            record.write_text(json.dumps({"waited_s": before + time.time() - since}))
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def waited_s(out: Path, now: float | None = None) -> float:
    """Seconds the repository graded into ``out`` has spent waiting for its observer's turn, the wait
    still going on included (0 where it never waited, or its record is unreadable)."""
    try:
        record = json.loads((out / WAIT_FILE).read_text())
        waited = float(record.get("waited_s", 0.0))
        since = record.get("since")
        if since is not None:
            waited += max(0.0, (time.time() if now is None else now) - float(since))
        return max(0.0, waited)
    except (OSError, ValueError, TypeError, AttributeError):
        return 0.0
