"""A check's verdict as plain JSON (it crosses a process boundary): passed, failed with the properties
that missed and by how much, or skipped with the reason."""

from __future__ import annotations

import math
from typing import Any

import torch

PASSED, FAILED, SKIPPED = "passed", "failed", "skipped"


def passed() -> dict:
    return {"status": PASSED}


def failed(message: str) -> dict:
    return {"status": FAILED, "message": message}


def skipped(reason: str) -> dict:
    return {"status": SKIPPED, "message": reason}


def from_misses(misses: list[str | None], limit: int = 12) -> dict:
    found = [m for m in misses if m]
    if not found:
        return passed()
    more = f"\n... and {len(found) - limit} more" if len(found) > limit else ""
    return failed("\n".join(found[:limit]) + more)


def fmt(x: float) -> str:
    return f"{x:.2g}" if math.isfinite(x) else str(x)


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def describe(exc: BaseException) -> dict[str, Any]:
    """An exception raised by the implementation, as a failure naming where it was raised."""
    tb = exc.__traceback__
    where = ""
    while tb is not None:
        where = f" ({tb.tb_frame.f_code.co_filename}:{tb.tb_lineno})"
        tb = tb.tb_next
    top = (getattr(exc, "name", None) or "").split(".")[0]
    if isinstance(exc, ModuleNotFoundError) and top and top not in ("cs336_systems", "cs336_basics", "tests"):
        return failed(
            f"missing dependency {top!r} (imported{where}): install it into the grading environment"
        )
    return failed(f"raised {first_line(exc)}{where}")


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double().cpu() - b.detach().double().cpu()).abs().max().item()
