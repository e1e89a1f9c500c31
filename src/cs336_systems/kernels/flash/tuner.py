"""The tuner: each kernel's config per tuning key, chosen once per process among the key's candidates and
cached (in memory, and in a JSON file when ``FlashSettings.tune_cache`` names one).

Why not ``@triton.autotune``: a key's candidates span two kernel families (Triton and Gluon, whose
launches take different arguments) and a whole backward; a call pays our launcher's host time, which
autotune's do_bench leaves out; and the candidates compile side by side before any is timed, which halves
cold tuning. Candidates are timed in interleaved rounds with the order rotated per round and each one's median
round counts: timed one after the other, near-ties went whichever way the clocks drifted. Measured:
docs/perf-notes.md, FlashAttention-2, "Compiles side by side" and "Cached tensor maps, a drift-proof tuner".
"""

from __future__ import annotations

import json
import math
import os
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict
from typing import Any, Protocol

import torch
import triton

from .configs import TileConfig, key_str, parse_key
from .settings import INTERPRET, FlashSettings, flash_settings
from .tune_table import TuneTable, device_table

Timer = Callable[[Callable[[], None]], float]


class Compilable(Protocol):
    def warmup(self) -> None: ...


def sustained_time_ms(launch: Callable[[], None], budget_ms: float = 300.0, warm_ms: float = 100.0) -> float:
    """Per launch of ~``budget_ms`` of back-to-back launches, after ~``warm_ms`` of them untimed. On a
    host-bound case the events wait for the host, so its time counts as in a loop. It replaced 5 ms bursts
    of event plus host enqueue time, which ranked whole backwards otherwise than do_bench: at (1, 16,
    16384, 64) bursts preferred the split backward and do_bench the one-pass one (not established why:
    sustained clocks are the first suspect). Measured, by timer: docs/perf-notes.md, current figures,
    "leaderboard backward, split vs one-pass, by timer"."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    for _ in range(max(1, min(2000, int(warm_ms / once)))):
        launch()
    reps = max(1, min(5000, int(budget_ms / once)))
    start.record()
    for _ in range(reps):
        launch()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def warm_clocks(launch: Callable[[], None], ms: float = 20.0) -> None:
    """Keep the GPU busy for ~``ms``, one launch at a time, so that timing starts on boosted clocks:
    compiles leave it idle for seconds."""
    torch.cuda.synchronize()
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        launch()
        torch.cuda.synchronize()


class CandidateFailed(Exception):
    """A candidate config failed to build or launch (the reason is in :meth:`Tuner.report`)."""


class Tuner:
    """Chosen configs by tuning key, with the timings behind each choice, where each came from and why
    candidates failed. ``timer`` and ``warm_up`` are the GPU clock, ``can_time`` says whether there is one
    (not under Triton's CPU interpreter), ``table`` gives the shipped tuning table; tests pass their own.
    ``settings``: fixed settings instead of the ones in force (:func:`configured`)."""

    ROUNDS = 3

    def __init__(
        self,
        timer: Timer = sustained_time_ms,
        warm_up: Callable[[Callable[[], None]], None] = warm_clocks,
        can_time: bool = not INTERPRET,
        table: Callable[[], TuneTable] = device_table,
        settings: FlashSettings | None = None,
    ):
        self.timer, self.warm_up, self.can_time, self.table = timer, warm_up, can_time, table
        self.settings = settings
        self.cache: dict[tuple, TileConfig] = {}
        self.timings: dict[tuple, dict[str, float]] = {}
        self.sources: dict[tuple, str] = {}  # "tuned", "tune cache" (the settings' file) or "table"
        self.forced: dict[str, TileConfig] = {}
        self.errors: dict[str, str] = {}
        self.tune_seconds = 0.0  # wall time spent tuning (compiles included) in this process
        self._loaded_from: str | None = None

    def choose(
        self,
        kernel: str,
        key: tuple,
        candidates: Sequence[TileConfig],
        launch: Callable[[TileConfig], None],
        calls: Callable[[TileConfig], Sequence[Compilable]] | None = None,
    ) -> TileConfig:
        """The config for ``key``: forced, cached, the first candidate (tuning off, the interpreter, one
        candidate), or the fastest by ``timer`` (:func:`sustained_time_ms`). Every candidate is built
        (``launch(c)`` compiles and launches it) before any is timed; ``calls(c)``, a candidate's launches,
        lets them compile side by side first."""
        if kernel in self.forced:
            return self.forced[kernel]
        settings = self.settings or flash_settings()
        known = self.lookup(key, candidates)
        if known is not None:
            return known
        if not settings.autotune or not self.can_time or len(candidates) == 1:
            return candidates[0]
        start = time.perf_counter()
        if calls is not None and len(candidates) > 1:
            compile_side_by_side(candidates, calls, settings.compile_threads)
        steps = {c: self._guarded(key, c, launch) for c in candidates}
        built = {c: step for c, step in steps.items() if _builds(step)}
        timings = {str(c): math.inf for c in candidates}
        if built:
            timings.update(self._time(built))
        cfg = min(candidates, key=lambda c: timings[str(c)])
        if math.isinf(timings[str(cfg)]):
            raise RuntimeError(f"no candidate config builds for {key_str(key)}: {self.errors}")
        self.timings[key], self.cache[key], self.sources[key] = timings, cfg, "tuned"
        self.tune_seconds += time.perf_counter() - start
        self._save(settings.tune_cache)
        return cfg

    def lookup(self, key: tuple, candidates: Sequence[TileConfig]) -> TileConfig | None:
        """The config ``key`` already has, untimed: chosen in this process, in the settings' tune cache, or
        (tuning on) in this GPU's shipped table while still one of ``candidates``; else None."""
        settings = self.settings or flash_settings()
        self._load(settings.tune_cache)
        if key in self.cache:
            return self.cache[key]
        if not (settings.autotune and settings.tune_table and self.can_time):
            return None
        listed = self.table().entries.get(key)
        if listed is None or listed not in candidates:
            return None
        self.cache[key], self.sources[key] = listed, "table"
        return listed

    def source(self, key: tuple) -> str:
        """Where ``key``'s config came from: "tuned", "table", "tune cache" (the settings' file), or
        "default" (none chosen yet: a call takes the first candidate)."""
        return self.sources.get(key) or ("tune cache" if key in self.cache else "default")

    def _time(self, built: dict[TileConfig, Callable[[], None]]) -> dict[str, float]:
        """Median ms of each candidate over interleaved rounds, the order rotated per round."""
        self.warm_up(next(iter(built.values())))
        rounds: dict[TileConfig, list[float]] = {c: [] for c in built}
        order = list(built)
        for r in range(self.ROUNDS):
            for c in order[r % len(order) :] + order[: r % len(order)]:
                try:
                    rounds[c].append(self.timer(built[c]))
                except CandidateFailed:
                    rounds[c].append(math.inf)
        return {str(c): statistics.median(t) for c, t in rounds.items()}

    def _guarded(self, key: tuple, c: TileConfig, launch: Callable[[TileConfig], None]) -> Callable[[], None]:
        """``launch(c)`` that records why it failed and raises CandidateFailed."""

        def run() -> None:
            try:
                launch(c)
            except Exception as exc:
                reason = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else ""
                self.errors[f"{key_str(key)}|{c}"] = f"{type(exc).__name__}: {reason}"
                raise CandidateFailed from exc

        return run

    @contextmanager
    def forcing(self, kernel: str, config: TileConfig) -> Iterator[None]:
        """Pin ``kernel`` to ``config`` for a while (tests check every candidate)."""
        previous = self.forced.get(kernel)
        self.forced[kernel] = config
        try:
            yield
        finally:
            if previous is None:
                self.forced.pop(kernel, None)
            else:
                self.forced[kernel] = previous

    def clear(self) -> None:
        self.cache.clear()
        self.timings.clear()
        self.sources.clear()
        self.tune_seconds = 0.0

    def report(self) -> dict[str, Any]:
        """Chosen config, where it came from and candidate timings (ms) per key, build errors, seconds
        spent tuning, and the shipped table (path, keys, why not used)."""
        keys = {
            key_str(k): {
                "chosen": str(v),
                "source": self.source(k),
                "timings_ms": self.timings.get(k, {}),
            }
            for k, v in self.cache.items()
        }
        return {
            "keys": keys,
            "build_errors": dict(self.errors),
            "tune_seconds": self.tune_seconds,
            "table": self.table().describe(),
        }

    def _load(self, path: str | None) -> None:
        if path == self._loaded_from:
            return
        self._loaded_from = path
        if path and os.path.exists(path):
            with open(path) as f:
                for text, cfg in json.load(f).items():
                    self.cache.setdefault(parse_key(text), TileConfig(**cfg))

    def _save(self, path: str | None) -> None:
        if path:
            with open(path, "w") as f:
                json.dump({key_str(k): asdict(v) for k, v in self.cache.items()}, f, indent=1, sort_keys=True)


def compile_side_by_side(
    candidates: Sequence[TileConfig], calls: Callable[[TileConfig], Sequence[Compilable]], threads: int
) -> None:
    """Compile the candidates' kernels in a thread pool (Triton's AsyncCompileMode), so that building them
    one by one finds them compiled: a cold key's tuning is mostly compiles, and ptxas and most MLIR passes
    run outside the GIL. A candidate that fails here is compiled again when built, which records why."""
    if threads < 2:
        return
    with ThreadPoolExecutor(threads) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        for c in candidates:
            try:
                for call in calls(c):
                    call.warmup()
            except Exception:  # the candidate's own build reports it
                continue


def _builds(step: Callable[[], None]) -> bool:
    """Compile and launch a candidate once; one that fails is skipped."""
    try:
        step()
    except CandidateFailed:
        return False
    return True


# The process's tuner: every plan chooses through it.
TUNER = Tuner()
