"""The FlashAttention kernels' knobs as one object, read from ``CS336_FLASH_*`` once at import.

Code that needs another setting for a while (a test that turns tuning off, a bench that pins a tuning
cache) passes it through :func:`configured`, which swaps the current :class:`FlashSettings` and restores it
on exit; nothing patches module globals. (A kernel module may not import the harness, so these knobs are
read here rather than in ``harness/settings.py``, which lists them.)
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, replace

from ..checks import INTERPRET

__all__ = ["INTERPRET", "FlashSettings", "configured", "flash_settings"]


@dataclass(frozen=True)
class FlashSettings:
    # False: each kernel runs the first (heuristic) candidate of its case, untimed.
    autotune: bool = True
    # A JSON file that keeps tuning results across processes (read at first use, rewritten on change).
    tune_cache: str | None = None
    # Threads that compile a key's candidates side by side before they are timed (1: one after the other).
    # With 8, cold tuning of the grid takes about half the time (docs/perf-notes.md, FlashAttention-2,
    # "Compiles side by side").
    compile_threads: int = min(8, os.cpu_count() or 1)
    # The tuning table shipped for this GPU model (tune_table.py): its keys take their config untimed.
    tune_table: bool = True

    def __post_init__(self) -> None:
        if self.compile_threads < 1:
            raise ValueError(f"compile_threads must be >= 1, got {self.compile_threads}")

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> FlashSettings:
        """``CS336_FLASH_AUTOTUNE`` and ``CS336_FLASH_TUNE_TABLE`` ("0" off), ``CS336_FLASH_TUNE_CACHE``
        (a path) and ``CS336_FLASH_COMPILE_THREADS`` (an integer >= 1); a bad value names its variable."""
        autotune, table = (_switch(env, f"CS336_FLASH_{name}") for name in ("AUTOTUNE", "TUNE_TABLE"))
        threads = env.get("CS336_FLASH_COMPILE_THREADS", "").strip()
        try:
            compile_threads = int(threads) if threads else cls.compile_threads
        except ValueError:
            raise ValueError(f"CS336_FLASH_COMPILE_THREADS must be an integer, got {threads!r}") from None
        return cls(
            autotune=autotune,
            tune_table=table,
            tune_cache=env.get("CS336_FLASH_TUNE_CACHE", "").strip() or None,
            compile_threads=compile_threads,
        )


def _switch(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"


_current = FlashSettings.from_env()


def flash_settings() -> FlashSettings:
    """The settings in force."""
    return _current


@contextmanager
def configured(**changes: object) -> Iterator[FlashSettings]:
    """``with configured(autotune=False): ...``: the current settings with ``changes``, restored on exit."""
    global _current
    previous = _current
    _current = replace(previous, **changes)
    try:
        yield _current
    finally:
        _current = previous
