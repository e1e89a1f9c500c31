"""Process-group setup from torchrun's environment variables.

Both launchers end here: ``torchrun --nproc-per-node N ...`` sets RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT, and :func:`cs336_systems.distributed.launch.spawn` sets the same ones in
each child it starts, so a bench or test runs unchanged on one machine or across nodes.
"""

from __future__ import annotations

import datetime
import gc
import importlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankInfo:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device


def default_backend(local_world_size: int) -> str:
    """nccl when every local rank can have its own GPU, else gloo on CPU."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= local_world_size:
        return "nccl"
    return "gloo"


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except KeyError:
        raise RuntimeError(
            f"{name} is not set: start this under torchrun or cs336_systems.distributed.launch.spawn"
        ) from None


def init_distributed(backend: str | None = None, timeout_s: float = 120.0) -> RankInfo:
    """Join the process group described by the environment; one device per local rank.

    The timeout bounds every collective, so a peer that died turns into an error, not a hang.
    """
    rank, world_size = _env_int("RANK"), _env_int("WORLD_SIZE")
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = backend or default_backend(local_world_size)
    if backend == "nccl":
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            raise RuntimeError(
                f"backend nccl needs a GPU for local rank {local_rank}; found {torch.cuda.device_count()}"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        # NVLink SHARP / multicast must stay off on the shared lent machines.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    else:
        device = torch.device("cpu")
    if not dist.is_initialized():
        # torch._dynamo, imported after the group exists (any torch.optim optimizer imports it),
        # keeps a reference that outlives destroy_process_group: gloo's threads then live until
        # interpreter exit, where their teardown can abort the process (issue 38). Imported first,
        # it holds none.
        importlib.import_module("torch._dynamo")
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    return RankInfo(rank, world_size, local_rank, backend, device)


def shutdown(barrier: bool = False) -> None:
    """Leave the process group. ``barrier``: first wait until every rank got here (a rank that
    finished must not close its connections while a peer still communicates over them), after
    collecting garbage, so that collective ``Work`` handles caught in reference cycles release gloo's
    device now, with the group, rather than at interpreter exit."""
    if not dist.is_initialized():
        return
    gc.collect()
    if barrier:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
        dist.barrier(device_ids=[device.index] if device is not None else None)
    dist.destroy_process_group()
    gc.collect()
