"""The worker's process group and devices: gloo (the course's backend; nccl only for timing jobs),
initialized from the environment the runner sets (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with a
collective timeout so that a rank left waiting on a crashed peer fails instead of hanging."""

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


def device_for(placement: str, rank: int) -> torch.device:
    """A case's device on this rank. ``course``: the course's ``_setup_process_group``, i.e.
    ``cuda:{rank % device_count}`` whenever CUDA is available, else the CPU; ``cuda``: the same GPU, or
    the CPU where there is none (a Triton case's stand-in, under the interpreter); ``cpu``: the CPU."""
    if placement != "cpu" and torch.cuda.is_available():
        index = rank % torch.cuda.device_count()
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def gather(obj: object) -> list:
    """Every rank's ``obj`` (a one-element list in a single process): the timing jobs' slowest rank."""
    if not dist.is_initialized():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out
