"""The worker's process group: gloo on the CPU (or nccl on GPUs for timing jobs), initialized from the
environment the runner sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with a collective timeout so
that a rank left waiting on a crashed peer fails instead of hanging."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT_S = 20  # a healthy toy-model collective takes milliseconds, even on 2 loaded cores


def init(backend: str = "gloo") -> tuple[int, int]:
    rank, world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if world_size > 1 and not dist.is_initialized():
        if backend == "nccl":
            torch.cuda.set_device(rank % torch.cuda.device_count())
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        )
    return rank, world_size


def close() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)


def shard_batch(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of the global batch (dimension 0)."""
    if t.shape[0] % world_size:
        raise ValueError(f"batch {t.shape[0]} does not divide over {world_size} ranks")
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def gather(obj: object) -> list:
    """Every rank's ``obj`` (a one-element list in a single process)."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
