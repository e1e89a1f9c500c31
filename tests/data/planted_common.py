"""The suite's own hooks (``tests/adapters.py``), for the planted-bug adapters files to start from:
each of them takes these and breaks one hook family."""

from __future__ import annotations

from pathlib import Path

from cs336_systems.harness.adapters import load_adapters

SUITE = load_adapters(Path(__file__).resolve().parents[1] / "adapters.py")
HOOK_PREFIXES = ("get_", "ddp_", "fsdp_")


def suite_hooks() -> dict:
    """Every hook of the suite's adapters file, by name (for ``globals().update``)."""
    return {n: getattr(SUITE, n) for n in dir(SUITE) if n.startswith(HOOK_PREFIXES)}
