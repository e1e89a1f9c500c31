"""Synchronized step timing and the glue that records a case into pytest-benchmark.

Device work is asynchronous, so every timed step ends with a device synchronize (handout 1.1.3):
the host clock then measures the step on the device, launch overhead included. Warm-up steps run
before timing so compilation, autotuning and allocator growth stay out of the numbers.
"""

from __future__ import annotations

import gc
import statistics
import timeit
from collections.abc import Callable
from typing import Any

import torch


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


def free_device_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_mib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else None


def record_oom(benchmark: Any, **extra_info: Any) -> None:
    """Record an out-of-memory case as a result row: ``extra_info['oom'] = True`` and a no-op timing,
    so the case still appears in the JSON (and as "OOM" in the tables) and the sweep goes on."""
    free_device_memory()
    benchmark.extra_info.update(extra_info, oom=True)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def run_benchmark(
    benchmark: Any,
    step: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int,
    rounds: int,
    setup: Callable[[], Any] | None = None,
    **extra_info: Any,
) -> list[float] | None:
    """Time ``step`` into pytest-benchmark, ``rounds`` synchronized rounds after ``warmup`` ones.

    Returns the per-round times in ms, or None when the case ran out of device memory (then recorded
    as an OOM row). ``setup`` runs before every round, untimed (e.g. to zero gradients).
    """
    times: list[float] = []
    # pytest-benchmark's fixture may be used once: an OOM raised inside pedantic() (a timed round)
    # would make record_oom's own pedantic() call fail with FixtureAlreadyUsed. So rounds catch OOM
    # themselves, the remaining rounds become no-ops, and the row is marked OOM afterwards.
    ran_out = False

    def guarded(fn: Callable[[], Any]) -> None:
        nonlocal ran_out
        if ran_out:
            return
        try:
            fn()
        except Exception as exc:
            if not is_oom(exc):
                raise
            ran_out = True

    def timed() -> None:
        def run() -> None:
            start = timeit.default_timer()
            step()
            synchronize(device)
            times.append((timeit.default_timer() - start) * 1e3)

        guarded(run)

    def warmed_setup() -> None:
        if setup is not None:
            setup()
        synchronize(device)

    reset_peak_memory(device)
    try:
        for _ in range(warmup):
            warmed_setup()
            step()
            synchronize(device)
    except Exception as exc:  # torch raises OOM as several exception types across backends
        if not is_oom(exc):
            raise
        record_oom(benchmark, **extra_info)
        return None
    times.clear()
    benchmark.pedantic(
        timed, setup=lambda: guarded(warmed_setup), rounds=rounds, iterations=1, warmup_rounds=0
    )
    if ran_out:
        free_device_memory()
        benchmark.extra_info.update(extra_info, oom=True)
        return None
    benchmark.extra_info.update(extra_info, **summarize_ms(times), oom=False)
    peak = peak_memory_mib(device)
    if peak is not None:
        benchmark.extra_info["peak_memory_mib"] = peak
    return times


class Recorder:
    """A stand-in for pytest-benchmark's ``benchmark`` fixture outside pytest (the CLI, tests).

    Implements the part ``run_benchmark`` / ``record_oom`` use: ``extra_info`` and ``pedantic``
    (setup untimed before each round, ``warmup_rounds`` untimed rounds first). ``stats`` keeps the
    host-clock time of each round in seconds, as pytest-benchmark would.
    """

    def __init__(self, group: str | None = None):
        self.group = group
        self.extra_info: dict[str, Any] = {}
        self.stats: list[float] = []

    def pedantic(
        self,
        target: Callable[..., Any],
        args: tuple = (),
        kwargs: dict | None = None,
        setup: Callable[[], Any] | None = None,
        rounds: int = 1,
        iterations: int = 1,
        warmup_rounds: int = 0,
    ) -> Any:
        result = None
        for i in range(warmup_rounds + rounds):
            if setup is not None:
                setup()
            start = timeit.default_timer()
            for _ in range(iterations):
                result = target(*args, **(kwargs or {}))
            if i >= warmup_rounds:
                self.stats.append((timeit.default_timer() - start) / iterations)
        return result
