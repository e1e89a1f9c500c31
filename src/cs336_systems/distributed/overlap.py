"""How much of the communication runs concurrently with computation, from a torch.profiler trace.

Overlap share = |union(NCCL kernels) ∩ union(other kernels)| / |union(NCCL kernels)|, over the
device timeline of one rank: 0 when every all-reduce runs while the compute stream is idle (naive
DDP after backward), near 1 when it hides entirely behind backward kernels. Kernel intervals come
from the Chrome trace that ``torch.profiler`` exports (events with ``cat == "kernel"``), which is
also the trace one opens in Perfetto / chrome://tracing to see the overlap. Copies and memsets are
neither communication nor compute and are left out.
"""

from __future__ import annotations

import gzip
import json
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval]) -> list[Interval]:
    """Union of [start, end) intervals as sorted, disjoint intervals."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def total(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in merge(intervals))


def intersection(a: Iterable[Interval], b: Iterable[Interval]) -> float:
    """Length of union(a) ∩ union(b), by a sweep over the two merged lists."""
    a, b = merge(a), merge(b)
    i = j = 0
    length = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        length += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return length


def is_comm_kernel(name: str) -> bool:
    return "nccl" in name.lower()


def kernel_intervals(trace: dict[str, Any]) -> tuple[list[Interval], list[Interval]]:
    """(communication, compute) kernel intervals in microseconds from a Chrome trace dict."""
    comm, compute = [], []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") != "kernel":
            continue
        start = float(event["ts"])
        interval = (start, start + float(event.get("dur", 0.0)))
        (comm if is_comm_kernel(event.get("name", "")) else compute).append(interval)
    return comm, compute


def hidden_shares(trace: dict[str, Any], pattern: str = "allgather") -> list[float]:
    """For each communication kernel whose name contains ``pattern`` (case-insensitive), the share
    of its duration that runs concurrently with compute kernels (D24(b): 1.0 = fully hidden)."""
    _, compute = kernel_intervals(trace)
    compute = merge(compute)
    shares = []
    for event in trace.get("traceEvents", []):
        name = event.get("name", "")
        if event.get("ph") != "X" or event.get("cat") != "kernel" or not is_comm_kernel(name):
            continue
        if pattern not in name.lower():
            continue
        start, dur = float(event["ts"]), float(event.get("dur", 0.0))
        if dur > 0:
            shares.append(intersection([(start, start + dur)], compute) / dur)
    return shares


def overlap_stats(trace: dict[str, Any], steps: int = 1) -> dict[str, float | None]:
    """``overlap_share`` (None without communication kernels, e.g. on CPU), the per-step
    communication / compute kernel time in ms, and over the all-gather kernels the mean and the
    minimum share hidden behind compute (None without all-gathers)."""
    comm, compute = kernel_intervals(trace)
    comm_us, compute_us = total(comm), total(compute)
    gathers = hidden_shares(trace, "allgather")
    return {
        "overlap_share": intersection(comm, compute) / comm_us if comm_us > 0 else None,
        "comm_kernel_ms": comm_us / 1e3 / steps,
        "compute_kernel_ms": compute_us / 1e3 / steps,
        "allgather_hidden_mean": sum(gathers) / len(gathers) if gathers else None,
        "allgather_hidden_min": min(gathers) if gathers else None,
        "allgather_kernels": len(gathers) / steps,
    }


def load_trace(path: str | os.PathLike) -> dict[str, Any]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)


def profile_overlap(
    step: Callable[[], Any],
    device: torch.device,
    steps: int = 1,
    trace_path: str | os.PathLike | None = None,
) -> dict[str, float | None]:
    """Run ``step`` ``steps`` times under torch.profiler and return :func:`overlap_stats`; the
    Chrome trace is kept at ``trace_path`` (``.json`` or ``.json.gz``) when given."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
        return overlap_stats(load_trace(trace_path), steps)
    with tempfile.TemporaryDirectory(prefix="cs336-trace-") as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return overlap_stats(load_trace(path), steps)
