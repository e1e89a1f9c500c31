"""Start N ranks on this machine, torchrun-style, and collect what each returns.

Used by the ``run_distributed`` fixture (tests, benches) and by scripts. Failure is loud and fast:
the first rank that raises fails the whole run with its traceback, the other ranks are killed
rather than left waiting in a collective, and a run past its deadline is killed too.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.connection
import os
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


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
    )
    out = Path(out_dir)
    try:
        init_distributed(backend, timeout_s=timeout)
        result = fn(*args)
        torch.save(result, out / f"rank{rank}.pt")
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1) from None
    finally:
        shutdown()


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
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="cs336-ranks-") as out_dir:
        procs = [
            ctx.Process(
                target=_rank_main,
                args=(fn, args, rank, world_size, port, backend, timeout, out_dir),
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
