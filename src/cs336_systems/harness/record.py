"""Recording a case into pytest-benchmark: timed rounds, replayed rank timings, OOM and not-run rows.

Everything here takes pytest-benchmark's ``benchmark`` fixture (or :class:`Recorder`, its stand-in for
the CLI and tests) and writes its rounds and ``extra_info``. The numbers a bench records in
``extra_info`` (``mean_ms``, ``std_ms``...) are the authoritative ones; the report reads them first.
"""

from __future__ import annotations

import json
import timeit
from collections.abc import Callable
from typing import Any

import torch

from cs336_systems.harness.settings import settings
from cs336_systems.profiling.memory import free_device_memory
from cs336_systems.profiling.timing import (
    gc_paused,
    is_oom,
    peak_memory_mib,
    reset_peak_memory,
    summarize_ms,
    synchronize,
)
from cs336_systems.rows.contention import contention_facts


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
    progress: Callable[[str, int, int], None] | None = None,
    **extra_info: Any,
) -> list[float] | None:
    """Time ``step`` into pytest-benchmark, ``rounds`` synchronized rounds after ``warmup`` ones.

    Returns the per-round times in ms, or None when the case ran out of device memory (then recorded
    as an OOM row). ``setup`` runs before every round, untimed (e.g. to zero gradients).
    ``progress(phase, done, total)`` ("warm-up" / "step") is told when a phase starts and after
    each of its steps (the CLI's progress lines).
    """
    report = progress or (lambda phase, done, total: None)
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
            report("step", len(times), rounds)

        guarded(run)

    def warmed_setup() -> None:
        if setup is not None:
            setup()
        synchronize(device)

    reset_peak_memory(device)
    try:
        for i in range(warmup):
            report("warm-up", i, warmup)
            warmed_setup()
            step()
            synchronize(device)
        if warmup:
            report("warm-up", warmup, warmup)
    except Exception as exc:  # torch raises OOM as several exception types across backends
        if not is_oom(exc):
            raise
        record_oom(benchmark, **extra_info)
        return None
    times.clear()
    report("step", 0, rounds)
    with gc_paused():  # as do_bench: a collection pass is no part of a step
        benchmark.pedantic(
            timed, setup=lambda: guarded(warmed_setup), rounds=rounds, iterations=1, warmup_rounds=0
        )
    if ran_out:
        free_device_memory()
        benchmark.extra_info.update(extra_info, oom=True)
        return None
    # the machine's load and the rounds' spread: whether the figure measured the case (rows.contention)
    benchmark.extra_info.update(extra_info, **summarize_ms(times), **contention_facts(times), oom=False)
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


def record_times(benchmark: Any, times_ms: list[float], **extra_info: Any) -> None:
    """Record externally measured durations (ms) as the benchmark's rounds.

    pytest-benchmark reads its clock once before and once after each round; here the clock is a
    replay of the measured durations, so round i lasts exactly ``times_ms[i]``. (The fixture's clock
    is the private ``_timer`` attribute; without it, only ``extra_info`` carries the figures.)
    """
    if not times_ms:
        raise ValueError("record_times needs at least one measured time")
    benchmark.extra_info.update(extra_info, **contention_facts(times_ms))
    durations = iter(t / 1e3 for t in times_ms)
    now = [0.0]

    def replayed_rank_timings() -> float:
        return now[0]

    def one_measured_step() -> None:
        now[0] += next(durations, 0.0)

    if hasattr(benchmark, "_timer"):
        benchmark._timer = replayed_rank_timings
        benchmark.pedantic(one_measured_step, rounds=len(times_ms), iterations=1, warmup_rounds=0)
    else:  # pragma: no cover - a pytest-benchmark without the attribute
        benchmark.pedantic(one_measured_step, rounds=1, iterations=1)


def record_not_run(benchmark: Any, status: str, reason: str, **extra_info: Any) -> None:
    """A result row for a case that was deliberately not run (``status`` "unsupported" or "skipped"),
    with the reason, so the table shows it instead of a hole; timing is a no-op like an OOM row.
    ``skipped`` carries the reason too: the report generator leaves such rows out of plots, and
    bench/conftest.py out of pytest-benchmark's terminal table (where the no-op would rank fastest)."""
    benchmark.extra_info.update(extra_info, status=status, reason=reason, skipped=reason, oom=False)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def log_case(benchmark: Any) -> None:
    """Append this case as one JSON line to ``$CS336_BENCH_JSONL`` when set, in the shape of a
    pytest-benchmark JSON entry, so a sweep killed by a time limit still leaves its finished rows."""
    path = settings().bench_jsonl
    if not path:
        return
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    row = {
        "group": getattr(benchmark, "group", None),
        "name": getattr(benchmark, "name", None),
        "params": getattr(benchmark, "params", None),
        "extra_info": dict(benchmark.extra_info),
        "stats": stats.as_dict() if stats is not None else None,
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
