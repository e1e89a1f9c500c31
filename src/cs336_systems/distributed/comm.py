"""Collective helpers shared by the DDP wrappers, the sharded optimizer and the benches.

Everything here works with any backend (gloo on CPU, nccl on GPU): averaging is a SUM followed by
a division because gloo has no ``ReduceOp.AVG``.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.units import mb_to_bytes


def world() -> tuple[int, int]:
    """(rank, world_size) of the default process group; (0, 1) when none is initialized."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def rank_device() -> torch.device:
    """The device this rank communicates from: its GPU under nccl, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def share_cpu_threads() -> None:
    """On CPU ranks, split the cores between the local ranks: with every rank using all cores the
    ranks oversubscribe the machine and the timings measure the scheduler."""
    if rank_device().type == "cpu":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world()[1]))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(local, 1)))


def require_process_group(who: str) -> None:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(
            f"{who} needs an initialized process group: start under torchrun or "
            "cs336_systems.distributed.launch.spawn (init_distributed())"
        )


def barrier(device: torch.device) -> None:
    """``dist.barrier`` naming the rank's GPU (nccl otherwise guesses it and warns)."""
    dist.barrier(device_ids=[device.index] if device.type == "cuda" else None)


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    """Parameters that receive gradients, each once (``parameters()`` already drops tied repeats)."""
    return [p for p in module.parameters() if p.requires_grad]


def parameter_names(module: nn.Module) -> dict[int, str]:
    """id(param) -> its first qualified name, for error messages."""
    names: dict[int, str] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), name)
    return names


def group_by_dtype_device(tensors: Iterable[torch.Tensor]) -> dict[tuple, list[torch.Tensor]]:
    """Tensors split by (device, dtype), order kept: one flat buffer can only hold one of each."""
    groups: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return groups


CHUNK_MB = 512.0


def flat_chunks(tensors: Iterable[torch.Tensor], chunk_mb: float = CHUNK_MB) -> list[list[torch.Tensor]]:
    """Tensors packed in order into chunks of one (device, dtype) and at most ``chunk_mb`` MiB (a
    larger tensor gets a chunk of its own), each to travel as one flat buffer: few calls, and the
    extra memory for the flat copies stays bounded by the chunk size instead of the model size."""
    cap = mb_to_bytes(chunk_mb)
    chunks: list[list[torch.Tensor]] = []
    for group in group_by_dtype_device(tensors).values():
        size = cap + 1
        for t in group:
            nbytes = t.numel() * t.element_size()
            if size + nbytes > cap:
                chunks.append([])
                size = 0
            chunks[-1].append(t)
            size += nbytes
    return chunks


@torch.no_grad()
def broadcast_tensors(
    tensors: Sequence[torch.Tensor] | Sequence[tuple[int, Sequence[torch.Tensor]]],
    src: int | None = 0,
    chunk_mb: float = CHUNK_MB,
    in_flight: int = 2,
) -> None:
    """Overwrite ``tensors`` on every rank with rank ``src``'s values, as flattened chunks
    (:func:`flat_chunks`) rather than one call per tensor. With ``src=None``, ``tensors`` is a list of
    ``(src, tensors)`` pairs (e.g. each rank's shard). Up to ``in_flight`` async broadcasts run at a
    time, so copying one chunk out overlaps with the next one's transfer."""
    rank, world_size = world()
    if world_size == 1:
        return
    sources = [(src, tensors)] if src is not None else tensors
    pending: list[tuple[dist.Work, int, torch.Tensor, list[torch.Tensor]]] = []

    def finish_oldest() -> None:
        work, owner, flat, chunk = pending.pop(0)
        work.wait()
        if owner != rank:
            torch._foreach_copy_(chunk, _unflatten_dense_tensors(flat, chunk))

    for owner, owned in sources:
        for chunk in flat_chunks(owned, chunk_mb):
            if owner == rank:
                flat = _flatten_dense_tensors(chunk)
            else:
                flat = torch.empty(
                    sum(t.numel() for t in chunk), device=chunk[0].device, dtype=chunk[0].dtype
                )
            pending.append((dist.broadcast(flat, src=owner, async_op=True), owner, flat, chunk))
            if len(pending) > in_flight:
                finish_oldest()
    while pending:
        finish_oldest()


def broadcast_module(module: nn.Module, src: int = 0) -> None:
    """Make every rank start from rank ``src``'s parameters and buffers (frozen ones included)."""
    broadcast_tensors([*module.parameters(), *module.buffers()], src=src)


def shard_batch(batch: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's contiguous slice of a global batch (dim 0); the batch must divide evenly, since
    an uneven split would make the slowest rank set the pace and bias the averaged gradient."""
    n = batch.shape[0]
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if n % world_size:
        raise ValueError(
            f"world size {world_size} does not divide the batch size {n}; "
            f"use a batch that is a multiple of {world_size}"
        )
    per_rank = n // world_size
    return batch[rank * per_rank : (rank + 1) * per_rank]
