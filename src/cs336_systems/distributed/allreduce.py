"""D13: all-reduce latency and bandwidth, run inside every rank of an initialized process group.

Method (handout 2.1.1, nccl-tests): a float32 tensor of ``nbytes`` on the rank's device, 5 warm-up
calls, then ``iters`` timed calls. Before each timed call the ranks line up (device synchronize +
barrier) so one rank's late start is not counted as the others' communication time. On CUDA each
call is timed with CUDA events on the current stream (a blocking ``all_reduce`` makes that stream
wait for the NCCL kernel); on CPU with the host clock. All ranks' times are gathered with
``all_gather_object``; a call is over when its slowest rank is done, so the figure per call is the
max over ranks.

Bandwidths follow nccl-tests (PERFORMANCE.md): algbw = bytes / time; busbw = algbw * 2(n-1)/n, the
per-link rate a ring all-reduce needs, comparable across world sizes and with the link's peak.
"""

from __future__ import annotations

import statistics
import timeit

import torch
import torch.distributed as dist

from cs336_systems.distributed.comm import barrier, rank_device, require_process_group, world
from cs336_systems.units import MIB

MB = MIB  # the labels say MB; the sizes are MiB (units.py)
SIZES = {"1MB": MB, "10MB": 10 * MB, "100MB": 100 * MB, "1GB": 1024 * MB}


def bus_factor(world_size: int) -> float:
    return 2 * (world_size - 1) / world_size


def bandwidths_gbps(nbytes: int, time_ms: float, world_size: int) -> tuple[float, float]:
    """(algbw, busbw) in GB/s (1e9 bytes) for an all-reduce of ``nbytes`` per rank."""
    algbw = nbytes / (time_ms * 1e-3) / 1e9
    return algbw, algbw * bus_factor(world_size)


def default_iters(nbytes: int, device: torch.device) -> int:
    """Timed calls per size: plenty for small messages, fewer for 1 GB and on the (slow) CPU."""
    calls = 50 if nbytes <= 10 * MB else 20 if nbytes <= 100 * MB else 10
    return calls if device.type == "cuda" else max(calls // 2, 5)


def _timed_allreduce(tensor: torch.Tensor) -> float:
    device = tensor.device
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        barrier(device)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dist.all_reduce(tensor)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    barrier(device)
    t0 = timeit.default_timer()
    dist.all_reduce(tensor)
    return (timeit.default_timer() - t0) * 1e3


def time_allreduce(
    nbytes: int, device: torch.device, warmup: int = 5, iters: int | None = None
) -> list[float]:
    """This rank's time (ms) of each of ``iters`` timed all-reduces of ``nbytes`` bytes of float32."""
    if nbytes % 4:
        raise ValueError(f"nbytes must be a multiple of 4 (float32), got {nbytes}")
    iters = default_iters(nbytes, device) if iters is None else iters
    tensor = torch.rand(nbytes // 4, device=device, dtype=torch.float32)
    for _ in range(warmup):
        dist.all_reduce(tensor)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    times = [_timed_allreduce(tensor) for _ in range(iters)]
    del tensor
    return times


def summarize(per_rank: list[list[float]], nbytes: int) -> dict[str, float | list[float]]:
    """Per-call max over ranks -> the step figures; plus the mean over ranks and calls."""
    world_size = len(per_rank)
    per_call = [max(ts) for ts in zip(*per_rank, strict=True)]
    mean = statistics.fmean(per_call)
    algbw, busbw = bandwidths_gbps(nbytes, mean, world_size)
    return {
        "times_ms": per_call,
        "mean_ms": mean,
        "std_ms": statistics.stdev(per_call) if len(per_call) > 1 else 0.0,
        "median_ms": statistics.median(per_call),
        "max_ms": max(per_call),
        "rank_mean_ms": statistics.fmean(t for ts in per_rank for t in ts),
        "algbw_gbps": algbw,
        "busbw_gbps": busbw,
    }


def allreduce_sweep(sizes: list[int], warmup: int = 5, iters: int | None = None) -> dict[int, dict]:
    """Rank function (run under ``spawn`` or torchrun): every size in one process group; returns,
    on every rank, the summary per size gathered from all ranks."""
    require_process_group("allreduce_sweep")
    _, world_size = world()
    device = rank_device()
    results = {}
    for nbytes in sizes:
        mine = time_allreduce(nbytes, device, warmup=warmup, iters=iters)
        gathered: list[list[float] | None] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        results[nbytes] = summarize(gathered, nbytes) | {
            "backend": dist.get_backend(),
            "world_size": world_size,
        }
    return results
