"""Whether a leaderboard row may be ranked: the rules, as a pure function of what the parent measured.

A row is ranked only when all of these hold, and otherwise says "no rank" naming each that failed:
1. **Correct work.** The Triton hook passes the course tier, and every timed iteration's outputs match
   the reference on the leaderboard's shape (``judge/clock.py``). A different output dtype with the
   right values costs nothing.
2. **The parent's time.** A finite, positive time per iteration on this process's clock, not under the
   GPU's dense peak for the FLOPs.
3. **Whose kernels.** Observed from outside the graded process (``observer.py``): at least
   ``MIN_SHARE`` of the observed GPU time is in kernels whose names the repository's own Triton source
   defines (``kernel_names.py``), and the timed run is not faster than those kernels took under the
   observer (else the timed work was not the observed work), nor much slower than all the GPU work the
   observer saw (else work was hidden from it). Where nothing observes, the graded
   process's own record decides (a repository kernel ran, torch's attention did not), and the row is
   marked self-reported and ranked below every observed row.

The course's figure (``do_bench`` mean in the graded process) is shown beside, and the row says when it
and the parent's time disagree by more than ``AGREEMENT``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..exchange import text
from ..observer import Observed
from . import provenance

# 90%: the real repositories whose forward and backward are Triton keep 94-99% of the observed GPU time
# in their own kernels (the rest is inductor's sum, the ones of the gradient, and torch's D = rowsum(dO*O)
# where they compute it in PyTorch); a PyTorch backward, or a borrowed attention beside a token kernel,
# leaves well under 60% (docs/grading.md, "The leaderboard").
MIN_SHARE = 0.90
# The timed run's iterations may be this much faster than its kernels' GPU time under the observer:
# ncu's per-kernel times carry the launch's own overhead.
OBSERVED_SLACK = 0.85
# The observed calls' GPU time is at least this share of the parent's time per iteration: the graded code
# can pause the observer (the profiler API is process-wide), and work it hides leaves the GPU time short.
# Honest rows: the kernels keep the GPU busy for 85-95% of an iteration at the leaderboard's shape.
COVERAGE = 0.5
# The parent's clock and the course's do_bench agree within this on honest rows (measured: the anchors
# and the real repositories, docs/grading.md); beyond it the row says so.
AGREEMENT = 0.10
# A course figure under half the parent's time is no noise: the graded process's timer was replaced, or
# its work skips the course loop's repeated inputs (a cache). Such a row is not ranked.
CLAIM_LIMIT = 0.5


@dataclass
class Evidence:
    """Everything the parent measured of one repository's row."""

    course_failures: list[str] | None  # the Triton hook's failing course cases; None: not graded
    clock_problem: str | None  # the clock's conversation, or a round that did not verify
    parent_ms: float | None
    course_ms: float | None
    floor_ms: float | None
    observed: Observed | None = None  # None: no observer on this machine
    observed_iterations: int = 0
    repo_kernels: set[str] = field(default_factory=set)
    self_record: Any = None  # the graded process's provenance record (used only without an observer)
    roots: list[Path] = field(default_factory=list)


def finite_positive(x: Any) -> float | None:
    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
    return float(x) if ok else None


def standing(e: Evidence) -> dict[str, Any]:
    misses: list[str] = []
    if e.course_failures is None:
        misses.append("the Triton hook's course tier was not graded in this run")
    elif e.course_failures:
        misses.append(f"the Triton hook fails the course tier ({', '.join(e.course_failures[:3])})")
    if e.clock_problem:
        misses.append(e.clock_problem)
    parent = finite_positive(e.parent_ms)
    if parent is None and not e.clock_problem:
        misses.append("no time on the parent's clock")
    if parent is not None and e.floor_ms and parent < e.floor_ms:
        misses.append(f"{parent:.3f} ms is below {e.floor_ms:.3f} ms, the GPU's dense peak for these FLOPs")
    row: dict[str, Any] = {"parent_ms": parent, "course_ms": finite_positive(e.course_ms)}
    if e.observed is not None:
        row |= _observed(e, parent, misses)
    else:
        row |= _self_reported(e, misses)
    row["agreement"] = _agreement(parent, row["course_ms"])
    if parent is not None and row["course_ms"] is not None and row["course_ms"] < CLAIM_LIMIT * parent:
        misses.append(
            f"the graded process's own do_bench reported {row['course_ms']:.3f} ms, under {CLAIM_LIMIT:g}x "
            f"the {parent:.3f} ms of the parent's clock: its timer, or work it skips on the repeated inputs "
            "of the course's loop"
        )
    row["ranked"] = not misses
    row["unranked_because"] = "; ".join(misses) or None
    return row


def _observed(e: Evidence, parent: float | None, misses: list[str]) -> dict[str, Any]:
    seen = e.observed
    assert seen is not None
    mine = {n for n in seen.kernels if n in e.repo_kernels}
    share = seen.share(mine)
    others = sorted(((ms, n) for n, ms in seen.kernels.items() if n not in mine), reverse=True)
    if seen.total_ms() <= 0:
        misses.append("the observer saw no GPU work inside the observed range")
    elif share < MIN_SHARE:
        shown = ", ".join(f"{text(n, 60)} ({ms / seen.total_ms():.0%})" for ms, n in others[:3])
        misses.append(
            f"{share:.0%} of the observed GPU time is in this repository's own Triton kernels (a rank "
            f"needs {MIN_SHARE:.0%}); the rest: {shown}"
        )
    seen_ms = seen.total_ms() / max(1, e.observed_iterations)
    if parent is not None and seen.total_ms() > 0 and seen_ms < COVERAGE * parent:
        misses.append(
            f"the observer saw {seen_ms:.3f} ms of GPU work per call of the {parent:.3f} ms timed: work was "
            "hidden from it"
        )
    mine_ms = sum(seen.kernels[n] for n in mine) / max(1, e.observed_iterations)
    if parent is not None and mine and parent < OBSERVED_SLACK * mine_ms:
        misses.append(
            f"the timed run took {parent:.3f} ms per iteration, less than the {mine_ms:.3f} ms its own "
            "kernels take under the observer: the timed work is not the observed work"
        )
    return {
        "attribution": "observed (ncu)",
        "repository_share": round(share, 4),
        "repository_kernels_ran": sorted(mine),
        "observed_ms_per_iteration": round(seen.total_ms() / max(1, e.observed_iterations), 4),
        "other_kernels": [text(n, 120) for _, n in others[:8]],
    }


def _self_reported(e: Evidence, misses: list[str]) -> dict[str, Any]:
    try:
        misses += provenance.attention_misses("triton", e.self_record, e.roots, on_gpu=True)
        ran = provenance.summary(e.self_record, e.roots)
    except Exception as exc:  # a malformed record is no attribution, never a crash
        misses.append(f"no usable record of what ran ({type(exc).__name__})")
        ran = {}
    return {"attribution": "self-reported", **ran}


def _agreement(parent: float | None, course: float | None) -> str:
    if parent is None or course is None:
        return "-"
    ratio = course / parent
    if abs(ratio - 1) <= AGREEMENT:
        return f"agree ({ratio:.2f}x)"
    return f"DISAGREE: the graded process's do_bench says {ratio:.2f}x the parent's clock"


def order(rows: list[dict]) -> list[dict]:
    """Ranked rows, observed ones first then self-reported, fastest first within each."""
    ranked = [r for r in rows if r.get("ranked") and finite_positive(r.get("parent_ms"))]
    return sorted(ranked, key=lambda r: (r.get("attribution") != "observed (ncu)", r["parent_ms"]))
