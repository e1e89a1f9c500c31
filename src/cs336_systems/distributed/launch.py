"""Start N ranks on this machine, torchrun-style, and collect what each returns.

Used by the ``run_distributed`` fixture (tests, benches) and by scripts. Failure is loud and fast:
the first rank that raises fails the whole run with its traceback, the other ranks are killed
rather than left waiting in a collective, and a run past its deadline is killed too.

Start and teardown are ordered so that a run cannot fail at random (issue 38):

- The parent hosts the rendezvous store on a port the OS picks and that stays bound for the whole
  run (the ranks connect as clients, as under torchrun's agent store). Picking a free port and
  binding it later in rank 0 leaves a window in which a concurrent run (xdist workers) can take the
  same port; and a store living in rank 0 dies with rank 0 while its peers may still use it.
- A rank that finished frees what it left behind and leaves the group in order: ``gc.collect``
  (a collective's ``Work`` handle in a reference cycle keeps gloo's device alive past
  ``destroy_process_group``), a barrier (no rank closes its connections while a peer still uses
  them), then ``destroy_process_group``.
- Then it leaves with ``os._exit``, its results already on disk: torch can keep gloo's threads
  running past ``destroy_process_group`` (``torch._dynamo`` imported after the group, a DeviceMesh,
  torch's DDP, any reachable ``Work``), and interpreter finalization and C++ static destructors
  tearing them down is where a rank aborted now and then with "terminate called without an active
  exception" (exit code -6, no traceback).
"""

from __future__ import annotations

import datetime
import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist


class RankFailedError(RuntimeError):
    pass


def find_free_port() -> int:
    """A port the OS reports free right now (bind to port 0); each run asks for its own."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(
    fn: Callable[..., Any],
    args: tuple,
    rank: int,
    world_size: int,
    port: int,
    backend: str | None,
    timeout: float,
    out_dir: str,
) -> None:
    from cs336_systems.distributed.process_group import init_distributed, shutdown

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        TORCHELASTIC_USE_AGENT_STORE="True",  # the store is the parent's: every rank is a client
    )
    out = Path(out_dir)
    ok = False
    try:
        init_distributed(backend, timeout_s=timeout)
        result = fn(*args)
        torch.save(result, out / f"rank{rank}.pt")
        del result
        ok = True
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
    finally:
        # after a failure the peers may be gone: no barrier then, the parent kills the run
        shutdown(barrier=ok)
    # Everything this rank reports is on disk: skip interpreter finalization, which would tear down
    # whatever native threads torch left running (see the module docstring).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if ok else 1)


_COLLECTIVE_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop", "pt_tcpstore")


def _collective_threads() -> list[str]:
    """Names of this process's threads that belong to gloo or the store (Linux: /proc/self/task):
    what a teardown left running (the tests check it)."""
    names = []
    task = Path("/proc/self/task")
    for t in task.iterdir() if task.is_dir() else ():
        try:
            name = (t / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(_COLLECTIVE_THREADS):
            names.append(name)
    return sorted(names)


def host_store(world_size: int, timeout: float) -> dist.TCPStore:
    """The rendezvous store, bound here on a port the OS picks, alive until the run is over."""
    return dist.TCPStore(
        "127.0.0.1",
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout),
        wait_for_workers=False,
    )


def spawn(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    backend: str | None = None,
    timeout: float = 120.0,
    startup_grace: float = 60.0,
) -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` fresh processes that have joined one process group.

    Returns the per-rank return values, in rank order (they must be picklable by ``torch.save``).
    The run is killed ``timeout + startup_grace`` seconds after the start (start-up imports torch).
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    ctx = mp.get_context("spawn")
    store = host_store(world_size, timeout + startup_grace)
    with tempfile.TemporaryDirectory(prefix="cs336-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, args, rank, world_size, store.port, backend, timeout, out_dir),
                name=f"rank{rank}",
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        try:
            _wait_all(procs, Path(out_dir), deadline=time.monotonic() + timeout + startup_grace)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join(5)
            del store  # every rank is gone: nobody uses it any more
        return [torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]


def _wait_all(procs: list[mp.Process], out_dir: Path, deadline: float) -> None:
    pending = {p.sentinel: rank for rank, p in enumerate(procs)}
    while pending:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"ranks {sorted(pending.values())} still running at the deadline; killed")
        for sentinel in multiprocessing.connection.wait(list(pending), timeout=remaining):
            rank = pending.pop(sentinel)
            # The sentinel can fire a moment before the child is reaped (exitcode still None).
            procs[rank].join(10)
            code = procs[rank].exitcode
            if code != 0:
                raise RankFailedError(_failure_report(len(procs), out_dir, rank, code))


def _failure_report(world_size: int, out_dir: Path, rank: int, code: int | None) -> str:
    """The root cause, not its echo: once one rank fails, its peers' collectives fail too, and any
    of them may be noticed first. A rank that died without a traceback is reported as is; otherwise
    the earliest traceback written is the cause."""
    errs = sorted(out_dir.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    if not (out_dir / f"rank{rank}.err").exists() or not errs:
        return f"rank {rank} of {world_size} failed:\nexited with code {code} and no traceback"
    first = int(errs[0].stem.removeprefix("rank"))
    later = [int(f.stem.removeprefix("rank")) for f in errs[1:]]
    note = f"\n(ranks {later} failed after it)" if later else ""
    return f"rank {first} of {world_size} failed:\n{errs[0].read_text()}{note}"
