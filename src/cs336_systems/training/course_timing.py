"""The course's timing protocol for the 2026 leaderboard (D26), beside the suite's median of timed steps,
and its cold-start rule.

The course times the step with ``triton.testing.do_bench(step, rep=30000, warmup=10000)`` (the mean, in
ms). :func:`course_do_bench` is that function's algorithm (triton 3.6), run on every rank: one call,
then 5 calls (each after clearing the L2 cache) whose mean estimates a step, then
``max(1, int(warmup / estimate))`` untimed calls and ``max(1, int(rep / estimate))`` timed ones, each
between two device events, after clearing the L2 cache; the result is the mean of those. One change, of
necessity: each call is a collective step, so every rank must make the same number of calls; the
estimate is agreed over ranks (the slowest rank's) before the counts are derived from it. At ~5 s a
step the course's values make 1 + 5 + 2 + 6 = 14 steps (~70 s); ``rep_ms`` / ``warmup_ms`` set them.

Cold start: the course requires a run from empty compile caches to finish within 10 minutes
(``COLD_START_LIMIT_S``); :func:`cold_start_verdict` applies it to a run's time since process start.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

COURSE_REP_MS = 30_000
COURSE_WARMUP_MS = 10_000
COLD_START_LIMIT_S = 600.0
ESTIMATE_CALLS = 5  # do_bench's fixed number of calls for its estimate


@dataclass(frozen=True)
class CourseCounts:
    n_warmup: int
    n_repeat: int


def course_counts(estimate_ms: float, warmup_ms: float, rep_ms: float) -> CourseCounts:
    """do_bench's numbers of warm-up and timed calls for a call that takes ``estimate_ms``."""
    return CourseCounts(max(1, int(warmup_ms / estimate_ms)), max(1, int(rep_ms / estimate_ms)))


class _Clock:
    """Device events on CUDA (do_bench's clock); the host clock after a synchronize elsewhere."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.device = device

    def mark(self) -> Any:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def ms(self, start: Any, end: Any) -> float:
        return start.elapsed_time(end) if self.cuda else (end - start) * 1e3


def _l2_flusher(device: torch.device) -> Callable[[], None]:
    """do_bench's L2 clear before each call (Triton's own buffer and clear) on CUDA; nothing on a CPU."""
    if device.type != "cuda":
        return lambda: None
    from triton import runtime

    cache = runtime.driver.active.get_empty_cache_for_benchmark()
    return lambda: runtime.driver.active.clear_cache(cache)


def _agreed_max(value: float, device: torch.device) -> float:
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def course_do_bench(
    step: Callable[[], Any],
    device: torch.device,
    rep_ms: float = COURSE_REP_MS,
    warmup_ms: float = COURSE_WARMUP_MS,
) -> dict[str, float]:
    """``triton.testing.do_bench(step, warmup=warmup_ms, rep=rep_ms)`` with the estimate agreed over
    ranks (module docstring). Returns ``course_mean_ms`` and how it was obtained."""
    clock, flush = _Clock(device), _l2_flusher(device)
    t_wall = time.perf_counter()
    step()
    clock.sync()
    start = clock.mark()
    for _ in range(ESTIMATE_CALLS):
        flush()
        step()
    end = clock.mark()
    clock.sync()
    estimate_ms = _agreed_max(clock.ms(start, end) / ESTIMATE_CALLS, device)
    counts = course_counts(estimate_ms, warmup_ms, rep_ms)
    for _ in range(counts.n_warmup):
        step()
    times = []
    for _ in range(counts.n_repeat):
        flush()
        if not clock.cuda:
            clock.sync()
        start = clock.mark()
        step()
        if not clock.cuda:  # the host clock needs the step finished; CUDA events are read at the end
            clock.sync()
        times.append((start, clock.mark()))
    clock.sync()
    ms = [clock.ms(a, b) for a, b in times]
    return {
        "course_mean_ms": sum(ms) / len(ms),
        "course_estimate_ms": estimate_ms,
        "course_n_warmup": counts.n_warmup,
        "course_n_repeat": counts.n_repeat,
        "course_rep_ms": rep_ms,
        "course_warmup_ms": warmup_ms,
        "course_wall_s": time.perf_counter() - t_wall,
    }


def cold_start_verdict(run_s: float | None, cold: bool, limit_s: float = COLD_START_LIMIT_S) -> bool | None:
    """True / False: a run from empty caches finished within / past ``limit_s`` (since process start);
    None when the caches were not empty (the figure says nothing of a cold run) or unknown."""
    if not cold or run_s is None:
        return None
    return run_s <= limit_s
