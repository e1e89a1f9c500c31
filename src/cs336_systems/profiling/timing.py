"""Synchronized step timing on the host clock, and device timing with ``triton.testing.do_bench``.

Device work is asynchronous, so every timed step ends with a device synchronize (handout 1.1.3):
the host clock then measures the step on the device, launch overhead included. Warm-up steps run
before timing so compilation, autotuning and allocator growth stay out of the numbers.
:func:`launch_time` times the other side: the host's issue of one call, to tell a device time that
measured the device from one that measured the host.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import statistics
import timeit
from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
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
    """CUDA's OutOfMemoryError, or the CPU allocator's RuntimeError ("can't allocate memory"):
    either way the case does not fit, which is a result, not a crash."""
    text = str(exc).lower()
    cpu = "can't allocate memory" in text or "not enough memory" in text
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in text or cpu


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


def _timer_name(device: torch.device) -> str:
    return "do_bench" if device.type == "cuda" else "host"


def _rep_times(
    fn: Callable[[], Any],
    *,
    device: torch.device,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> list[float]:
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none or []), return_mode="all"
        )
    return host_bench(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)


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
        times = _rep_times(fn, device=device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)
    return {
        "timer": _timer_name(device),
        "do_bench_ms": statistics.median(times),
        "do_bench_p20_ms": quantile(times, 0.2),
        "do_bench_p80_ms": quantile(times, 0.8),
        "do_bench_min_ms": min(times),
        "do_bench_reps": len(times),
    }


def _round_stats(rounds: list[list[float]]) -> dict[str, Any]:
    medians = [statistics.median(r) for r in rounds]
    pooled = [t for r in rounds for t in r]
    return {
        "do_bench_ms": statistics.median(medians),
        "do_bench_best_round_ms": min(medians),
        "do_bench_round_ms": medians,
        "do_bench_p20_ms": quantile(pooled, 0.2),
        "do_bench_p80_ms": quantile(pooled, 0.8),
        "do_bench_min_ms": min(pooled),
        "do_bench_reps": len(pooled),
    }


def interleaved_device_time(
    steps: Mapping[Hashable, Callable[[], Any]],
    device: torch.device,
    *,
    rounds: int,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Mapping[Hashable, Sequence[torch.Tensor]] | None = None,
    contexts: Mapping[Hashable, Callable[[], contextlib.AbstractContextManager]] | None = None,
    measure: Callable[..., list[float]] | None = None,
) -> dict[Hashable, dict[str, Any]]:
    """:func:`device_time` of several steps measured in ``rounds`` interleaved rounds: each round times
    every step once (``rep_ms`` of reps, the order rotated per round), so all steps see the same host
    and clocks. On a host whose speed drifts by tens of percent within a minute, timing one step after
    another compares one host state with another; within a round they share one. Per step:
    ``do_bench_ms`` is the median of the round medians, ``do_bench_round_ms`` the round medians in
    round order (pair them across steps with :func:`paired_ratio`). ``contexts[key]()`` is entered
    around each of the key's rounds, not each call (e.g. an SDPA backend pin, whose per-call cost would
    be charged to the step). ``measure(fn, warmup_ms, rep_ms, grad_to_none)`` returns one round's rep
    times (default: do_bench on CUDA, the host clock elsewhere)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    measure = measure or functools.partial(_rep_times, device=device)
    keys = list(steps)
    times: dict[Hashable, list[list[float]]] = {key: [] for key in keys}
    with gc_paused():
        for r in range(rounds):
            shift = r % len(keys) if keys else 0
            for key in keys[shift:] + keys[:shift]:
                grads = (grad_to_none or {}).get(key)
                with (contexts or {}).get(key, contextlib.nullcontext)():
                    reps = measure(steps[key], warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grads)
                times[key].append(reps)
    timer = _timer_name(device)
    return {key: {"timer": timer, "do_bench_rounds": rounds, **_round_stats(times[key])} for key in keys}


def paired_ratio(ours: Sequence[float], reference: Sequence[float]) -> float:
    """Median over rounds of ours / reference, round by round (both from one
    :func:`interleaved_device_time`): a ratio that host drift between rounds does not move."""
    return statistics.median(a / b for a, b in zip(ours, reference, strict=True))


def graph_time(fn: Callable[[], Any], *, rep_ms: float, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    """Device ms per call of ``fn`` replayed from one CUDA graph (``triton.testing.do_bench_cudagraph``,
    median of 10 replays of ~``rep_ms``): no host work between calls, so what a CUDA-graphed training
    step pays. L2 is not flushed between calls. do_bench_cudagraph calls ``fn`` once before capturing,
    so first-call work (plans, tuning, compiles) stays outside the graph."""
    from triton.testing import do_bench_cudagraph

    with gc_paused():
        return float(
            do_bench_cudagraph(fn, rep=rep_ms, grad_to_none=list(grad_to_none), return_mode="median")
        )


def launch_time(
    fn: Callable[[], Any], device: torch.device, *, reps: int = 20, grad_to_none: Sequence[torch.Tensor] = ()
) -> float:
    """Median host ms to issue one call of ``fn`` without waiting for the device (the queue drained
    before each call, grads of ``grad_to_none`` reset outside the timed region, gc paused). A call
    whose issue takes longer than its device time leaves the device idle between calls, so a device
    timer (do_bench's CUDA events) then measures the host's issue rate, which moves with the host's
    load. Call it warm (after do_bench): first-call compiles would count. On a CPU, the whole call."""
    times = []
    with gc_paused():
        for _ in range(reps):
            for t in grad_to_none:
                t.grad = None
            synchronize(device)  # an empty queue: the issue neither waits on nor overlaps earlier work
            start = timeit.default_timer()
            fn()
            times.append((timeit.default_timer() - start) * 1e3)
    synchronize(device)
    return statistics.median(times)


def rounds_for(ms: float, budget_ms: float = 100.0, lo: int = 3, hi: int = 20) -> int:
    """How many synchronized pytest-benchmark rounds to add after do_bench: about ``budget_ms`` of work,
    at least ``lo`` (so stddev exists), at most ``hi``."""
    return int(min(hi, max(lo, budget_ms // max(ms, 1e-6))))
