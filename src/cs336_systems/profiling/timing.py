"""Synchronized step timing on the host clock, and device timing with ``triton.testing.do_bench``.

Device work is asynchronous, so every timed step ends with a device synchronize (handout 1.1.3):
the host clock then measures the step on the device, launch overhead included. Warm-up steps run
before timing so compilation, autotuning and allocator growth stay out of the numbers.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import timeit
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from cs336_systems.units import MIB


def synchronize(device: torch.device | str | None = None) -> None:
    device = torch.device(device) if device is not None else None
    if (device is None or device.type == "cuda") and torch.cuda.is_available():
        torch.cuda.synchronize(device)


def time_steps(fn: Callable[[], Any], warmup: int, steps: int, device: torch.device) -> list[float]:
    """Run ``warmup`` untimed then ``steps`` timed calls; return each timed step in milliseconds."""
    for _ in range(warmup):
        fn()
        synchronize(device)
    times = []
    for _ in range(steps):
        start = timeit.default_timer()
        fn()
        synchronize(device)
        times.append((timeit.default_timer() - start) * 1e3)
    return times


def summarize_ms(times: list[float]) -> dict[str, float]:
    return {
        "mean_ms": statistics.fmean(times),
        "std_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
        "median_ms": statistics.median(times),
    }


def is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / MIB if device.type == "cuda" else None


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off while timing (pytest-benchmark's ``--benchmark-disable-gc``): in a
    pytest process holding thousands of collected cases a collection pass can take longer than the
    microsecond-scale calls being timed, and it lands on whichever rep happens to allocate past the
    threshold, more often for implementations that allocate Python objects per call."""
    enabled = gc.isenabled()
    gc.disable()  # no gc.collect() first: a full pass costs ~0.1 s in a big pytest process, per case
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def quantile(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=float), q))


def host_bench(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    max_reps: int = 100,
) -> list[float]:
    """do_bench's protocol with a host clock and a synchronize per rep, for devices without a Triton
    driver (the CPU variants): one call, an estimate of 5, warm-up and reps sized by time. Reps are
    capped at ``max_reps`` because a busy shared CPU makes the 5-call estimate unreliable."""
    fn()
    synchronize(device)
    start = timeit.default_timer()
    for _ in range(5):
        fn()
    synchronize(device)
    estimate_ms = max((timeit.default_timer() - start) * 1e3 / 5, 1e-6)
    for _ in range(min(max_reps, max(1, int(warmup_ms / estimate_ms)))):
        fn()
    times = []
    for _ in range(min(max_reps, max(1, int(rep_ms / estimate_ms)))):
        for t in grad_to_none or ():
            t.grad = None
        start = timeit.default_timer()
        fn()
        synchronize(device)
        times.append((timeit.default_timer() - start) * 1e3)
    return times


def device_time(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Device time of ``fn`` per call: ``triton.testing.do_bench`` on CUDA (CUDA events around each rep,
    L2 flushed between reps, grads of ``grad_to_none`` reset), the host-clock twin elsewhere, with the
    garbage collector paused (:func:`gc_paused`). The median is the authoritative number
    (``do_bench_ms``); 20/80 % quantiles and min go alongside."""
    with gc_paused():
        if device.type == "cuda":
            from triton.testing import do_bench

            times = do_bench(
                fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none or []), return_mode="all"
            )
            timer = "do_bench"
        else:
            times = host_bench(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)
            timer = "host"
    return {
        "timer": timer,
        "do_bench_ms": statistics.median(times),
        "do_bench_p20_ms": quantile(times, 0.2),
        "do_bench_p80_ms": quantile(times, 0.8),
        "do_bench_min_ms": min(times),
        "do_bench_reps": len(times),
    }


def rounds_for(ms: float, budget_ms: float = 100.0, lo: int = 3, hi: int = 20) -> int:
    """How many synchronized pytest-benchmark rounds to add after do_bench: about ``budget_ms`` of work,
    at least ``lo`` (so stddev exists), at most ``hi``."""
    return int(min(hi, max(lo, budget_ms // max(ms, 1e-6))))
