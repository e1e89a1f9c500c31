"""How much of the communication runs concurrently with computation, from a torch.profiler trace.

Overlap share = |union(NCCL kernels) ∩ union(other kernels)| / |union(NCCL kernels)|, over the
device timeline of one rank: 0 when every all-reduce runs while the compute stream is idle (naive
DDP after backward), near 1 when it hides entirely behind backward kernels. Kernel intervals come
from the Chrome trace that ``torch.profiler`` exports (events with ``cat == "kernel"``), which is
also the trace one opens in Perfetto / chrome://tracing to see the overlap. Copies and memsets are
neither communication nor compute and are left out.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import json
import os
import re
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


_LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
_RANGE = re.compile(r"fsdp\.(allgather|forward)\[(\d+)\]$")


def _unit_ranges(trace: dict[str, Any]) -> list[tuple[str, int, Any, float, float]]:
    """(kind, unit, thread, start, end) of the ``fsdp.allgather[i]`` / ``fsdp.forward[i]`` host
    ranges our FSDP opens under the profiler, by start."""
    ranges = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X" or event.get("cat") != "user_annotation":
            continue
        match = _RANGE.match(event.get("name", ""))
        if match:
            start = float(event["ts"])
            ranges.append(
                (match[1], int(match[2]), event.get("tid"), start, start + float(event.get("dur", 0.0)))
            )
    return sorted(ranges, key=lambda r: r[3])


def unit_readiness(trace: dict[str, Any]) -> list[dict[str, float | int | bool]]:
    """Per unit forward in the trace: was its all-gather done when the compute stream could start it?

    A kernel belongs to a host range when its launch (the runtime / driver call with the same
    correlation id) lies inside the range on the same thread. A unit forward's compute kernels are
    the non-NCCL kernels launched inside ``fsdp.forward[i]`` but outside every ``fsdp.allgather[*]``
    (a prefetch's cast / copy-in runs on the gather stream). Its all-gather is the NCCL all-gather
    kernel of the last ``fsdp.allgather[i]`` range opened before that forward's first kernel launch.
    The compute stream could start the unit at ``ready_at`` = max(end of the compute kernels that
    started before the unit's first one, host launch time of that first kernel); the gather is
    ``ready`` when it ended by then, and ``exposed_us`` = max(0, min(gather end, first start) -
    ready_at) is the time the compute stream sat idle waiting for it alone."""
    launches: dict[Any, tuple[Any, float]] = {}
    kernels = []
    for event in trace.get("traceEvents", []):
        if event.get("ph") != "X":
            continue
        corr = (event.get("args") or {}).get("correlation")
        if event.get("cat") in _LAUNCH_CATS and corr is not None:
            launches[corr] = (event.get("tid"), float(event["ts"]))
        elif event.get("cat") == "kernel":
            start = float(event["ts"])
            kernels.append((start, start + float(event.get("dur", 0.0)), event.get("name", ""), corr))
    ranges = _unit_ranges(trace)
    gathers = [r for r in ranges if r[0] == "allgather"]  # never nested in one another
    gather_starts = [g[3] for g in gathers]

    def gather_of(launch: tuple[Any, float] | None) -> int | None:
        if launch is None:
            return None
        i = bisect.bisect_right(gather_starts, launch[1]) - 1
        return i if i >= 0 and gathers[i][2] == launch[0] and launch[1] <= gathers[i][4] else None

    gather_end: dict[int, float] = {}  # index in ``gathers`` -> end of its NCCL all-gather kernel
    compute = []  # (start, end, launch) of non-communication kernels outside gather ranges
    unlinked = []  # all-gather kernels whose launch the trace lacks (e.g. a driver API not traced)
    for start, end, name, corr in kernels:
        launch = launches.get(corr)
        owner = gather_of(launch)
        if is_comm_kernel(name):
            if "allgather" not in name.lower():
                continue
            if owner is not None:
                gather_end[owner] = max(gather_end.get(owner, end), end)
            elif launch is None:
                unlinked.append((start, end))
        elif owner is None and launch is not None:
            compute.append((start, end, launch))
    orphans = [i for i in range(len(gathers)) if i not in gather_end]
    if unlinked and len(unlinked) == len(orphans):  # one NCCL stream runs them in launch order
        gather_end.update((i, end) for i, (_, end) in zip(orphans, sorted(unlinked), strict=True))
    compute.sort(key=lambda k: k[0])
    starts = [k[0] for k in compute]
    ends_max = list(itertools.accumulate((k[1] for k in compute), max))
    by_launch = sorted(compute, key=lambda k: k[2][1])
    launch_times = [k[2][1] for k in by_launch]
    out = []
    for kind, unit, tid, lo, hi in ranges:
        if kind != "forward":
            continue
        window = by_launch[bisect.bisect_left(launch_times, lo) : bisect.bisect_right(launch_times, hi)]
        mine = [k for k in window if k[2][0] == tid]
        if not mine:
            continue
        first = min(mine, key=lambda k: k[0])
        first_launch = min(k[2][1] for k in mine)
        feeding = [
            i
            for i, g in enumerate(gathers)
            if g[1] == unit and g[2] == tid and g[3] <= first_launch and i in gather_end
        ]
        if not feeding:
            continue
        done = gather_end[feeding[-1]]
        before = bisect.bisect_left(starts, first[0])
        ready_at = max(ends_max[before - 1] if before else first[2][1], first[2][1])
        out.append(
            {"unit": unit, "ready": done <= ready_at, "exposed_us": max(0.0, min(done, first[0]) - ready_at)}
        )
    return out


def overlap_stats(trace: dict[str, Any], steps: int = 1) -> dict[str, float | None]:
    """``overlap_share`` (None without communication kernels, e.g. on CPU), the per-step
    communication / compute kernel time in ms, over the all-gather kernels the mean and the
    minimum share hidden behind compute (None without all-gathers), and from our FSDP's unit ranges
    (:func:`unit_readiness`; None without them) the share of unit forwards whose all-gather was
    done in time and the per-step time the compute stream waited for gathers."""
    comm, compute = kernel_intervals(trace)
    comm_us, compute_us = total(comm), total(compute)
    gathers = hidden_shares(trace, "allgather")
    ready = unit_readiness(trace)
    return {
        "allgather_ready_share": sum(r["ready"] for r in ready) / len(ready) if ready else None,
        "allgather_exposed_ms": sum(r["exposed_us"] for r in ready) / 1e3 / steps if ready else None,
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
