"""CUDA memory: history snapshots for pytorch.org/memory_viz (handout 1.1.6) and peak-memory helpers."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from cs336_systems.profiling.timing import peak_memory_mib, reset_peak_memory, synchronize

MIB = 2**20


def free_device_memory(device: torch.device | str | None = None, *, collect: bool = True) -> None:
    """Return cached CUDA blocks between big cases, so the next case's model fits. ``collect`` runs the
    garbage collector first: needed after an exception (its traceback cycles keep tensors alive), but
    one collection costs 0.1-0.3 s with torch/inductor loaded, so per-case callers may skip it. Off
    CUDA (``device`` given and not cuda, or no GPU) there is nothing to return and nothing is done."""
    if device is not None and torch.device(device).type != "cuda":
        return
    if not torch.cuda.is_available():
        return
    if collect:
        gc.collect()
    torch.cuda.empty_cache()


def memory_allocated_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else None


def require_cuda(device: torch.device | str, what: str) -> torch.device:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError(f"{what} needs a CUDA device (the CUDA caching allocator records it); got {device}")
    return device


@contextlib.contextmanager
def memory_history(
    path: str | Path, device: torch.device | str, *, max_entries: int = 1_000_000, stacks: str = "python"
) -> Iterator[Path]:
    """Record every CUDA allocation and free inside the block, then dump the snapshot pickle to ``path``.

    ``stacks="python"`` keeps Python frames only (C++ frames multiply the file size for little gain).
    """
    require_cuda(device, "a memory snapshot")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks=stacks)
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None)


def snapshot_step(
    step: Callable[[], Any], path: str | Path, device: torch.device | str, *, warmup: int = 1, steps: int = 1
) -> dict[str, float]:
    """Run ``warmup`` steps unrecorded (allocator warm, optimizer state allocated), then record
    ``steps`` steps into the snapshot at ``path``. Returns the peak memory of the recorded steps and
    the snapshot size."""
    device = require_cuda(device, "a memory snapshot")
    for _ in range(warmup):
        step()
    synchronize(device)
    reset_peak_memory(device)
    with memory_history(path, device):
        for _ in range(steps):
            step()
        synchronize(device)
    return {
        "snapshot_peak_mib": peak_memory_mib(device) or 0.0,
        "snapshot_file_mib": Path(path).stat().st_size / MIB,
    }


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Allocated, reserved and peak-allocated memory in MiB (empty on the CPU)."""
    device = torch.device(device)
    if device.type != "cuda":
        return {}
    return {
        "allocated_mib": torch.cuda.memory_allocated(device) / MIB,
        "reserved_mib": torch.cuda.memory_reserved(device) / MIB,
        "peak_mib": torch.cuda.max_memory_allocated(device) / MIB,
    }


def measure_peak(fn: Callable[[], Any], device: torch.device | str) -> float | None:
    """Peak allocated MiB while ``fn`` runs (counting what was allocated before it); None on the CPU."""
    device = torch.device(device)
    reset_peak_memory(device)
    fn()
    synchronize(device)
    return peak_memory_mib(device)
