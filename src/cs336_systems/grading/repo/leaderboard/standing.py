"""Whether a leaderboard row may be ranked: the rules, as a pure function of what the parent measured.

A row is ranked only when all of these hold, and otherwise says "no rank" naming each that failed:
1. **Correct work.** The Triton hook passes the course tier, and every timed iteration's outputs match
   the reference on the leaderboard's shape (``repo/leaderboard/clock.py``). A different output dtype with the
   right values costs nothing.
2. **The parent's time.** A finite, positive time per iteration on this process's clock, not under the
   GPU's dense peak for the FLOPs.
3. **Whose kernels, phase by phase: the course's rule.** Observed from outside the graded process
   (``observer.py``), the forward and the backward apart. The handout asks for a Triton forward and a
   backward "by calling ``torch.compile`` on a regular PyTorch function (not Triton)", a Triton backward
   being an idea for improvement, and the course's board lists its own such baseline: so at least
   ``MIN_SHARE`` of the forward's GPU time is in kernels the repository's Triton source defines
   (``kernel_names.py``), at least ``MIN_SHARE`` of the backward's is in those or in code compiled from
   PyTorch (inductor's kernels and the library matmuls they call), and no library attention runs in
   either (torch's SDPA backends, ``flex_attention``'s templates, flash-attn: any attention kernel the
   repository did not write). The timed run is not faster than the repository's work took under the
   observer (else the timed work was not the observed work), nor much slower than all the GPU work the
   observer saw (else work was hidden from it). Where nothing observes, the graded process's own record
   decides (a repository kernel ran, torch's attention did not), and the row is marked self-reported and
   ranked below every observed row.

The course's figure (``do_bench`` mean in the graded process) is shown beside, and the row says when it
and the parent's time disagree by more than ``AGREEMENT``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ...exchange import text
from ...judge import provenance
from ...judge.kernel_names import GEMM_KIND, INDUCTOR_KIND, LIBRARY, OWN, by_kind, kind
from ...leaderboard_row import OBSERVED, finite_positive
from .observer import Observed, Phases

# 90%, per phase: the real repositories whose forward and backward are Triton keep 94-99% of the observed
# GPU time in their own kernels (the rest is inductor's sum, the ones of the gradient, and torch's
# D = rowsum(dO*O) where they compute it in PyTorch); a borrowed attention beside a token kernel leaves
# under 1% (docs/grading.md, "The leaderboard").
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
    phases: Phases | str | None = None  # the observed forward's and backward's kernels, or why not apart
    self_record: Any = None  # the graded process's provenance record (used only without an observer)
    roots: list[Path] = field(default_factory=list)


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
    others = sorted(((ms, n) for n, ms in seen.kernels.items() if n not in mine), reverse=True)
    calls = max(1, e.observed_iterations)
    row: dict[str, Any] = {
        "attribution": OBSERVED,
        "repository_share": round(seen.share(mine), 4),
        "repository_kernels_ran": sorted(mine),
        "observed_ms_per_iteration": round(seen.total_ms() / calls, 4),
        "other_kernels": [text(n, 120) for _, n in others[:8]],
    }
    if seen.total_ms() <= 0:
        misses.append("the observer saw no GPU work inside the observed range")
        return row
    work_ms = sum(seen.kernels[n] for n in mine) / calls
    if isinstance(e.phases, Phases):
        row |= {
            "forward": _design(e.phases.forward, e.repo_kernels),
            "backward": _design(e.phases.backward, e.repo_kernels),
        }
        misses += phase_misses(e.phases, e.repo_kernels)
        compiled = by_kind(e.phases.backward, e.repo_kernels)
        work_ms += (compiled.get(INDUCTOR_KIND, 0.0) + compiled.get(GEMM_KIND, 0.0)) / calls
    else:
        misses.append(f"the forward and the backward could not be told apart: {e.phases or 'not observed'}")
    seen_ms = seen.total_ms() / calls
    if parent is not None and seen_ms < COVERAGE * parent:
        misses.append(
            f"the observer saw {seen_ms:.3f} ms of GPU work per call of the {parent:.3f} ms timed: work was "
            "hidden from it"
        )
    if parent is not None and work_ms > 0 and parent < OBSERVED_SLACK * work_ms:
        misses.append(
            f"the timed run took {parent:.3f} ms per iteration, less than the {work_ms:.3f} ms its own "
            "kernels take under the observer: the timed work is not the observed work"
        )
    return row


# What each phase may run, beside the repository's own Triton kernels: the backward, code compiled from
# PyTorch (the handout's own design); the forward, nothing but small change (elementwise, copies).
ALLOWED = {"forward": {OWN}, "backward": {OWN, INDUCTOR_KIND, GEMM_KIND}}


def phase_misses(split: Phases, repo_kernels: set[str]) -> list[str]:
    """Why the observed phases do not rank: a library attention anywhere (named, with its phase), or a
    phase under ``MIN_SHARE`` in what it may run."""
    misses = []
    for phase, times in (("forward", split.forward), ("backward", split.backward)):
        library = sorted((n for n in times if kind(n, repo_kernels) == LIBRARY), key=lambda n: -times[n])
        if library:
            shown = ", ".join(text(n, 80) for n in library[:2])
            misses.append(f"a library's attention ran in the {phase}: {shown}")
        total = sum(times.values())
        allowed = sum(ms for n, ms in times.items() if kind(n, repo_kernels) in ALLOWED[phase])
        if total > 0 and allowed < MIN_SHARE * total:
            rest = sorted(
                ((ms, n) for n, ms in times.items() if kind(n, repo_kernels) not in ALLOWED[phase]),
                reverse=True,
            )
            shown = ", ".join(f"{text(n, 60)} ({ms / total:.0%})" for ms, n in rest[:3])
            what = (
                "its own Triton kernels"
                if phase == "forward"
                else "its own Triton kernels or code compiled from PyTorch"
            )
            misses.append(
                f"the {phase}: {allowed / total:.0%} of its GPU time is in {what} (a rank needs "
                f"{MIN_SHARE:.0%}); the rest: {shown}"
            )
    return misses


def _design(times: dict[str, float], repo_kernels: set[str]) -> str:
    """One phase in words: "own Triton 99%", "compiled PyTorch (inductor 55%, GEMMs 40%, own Triton 3%)"."""
    total = sum(times.values())
    if total <= 0:
        return "nothing observed"
    shares = sorted(((ms / total, k) for k, ms in by_kind(times, repo_kernels).items()), reverse=True)
    if shares[0][1] == OWN and shares[0][0] >= MIN_SHARE:
        return f"own Triton {shares[0][0]:.0%}"
    parts = ", ".join(f"{k} {share:.0%}" for share, k in shares if share >= 0.01)
    compiled = sum(share for share, k in shares if k in (INDUCTOR_KIND, GEMM_KIND))
    return f"compiled PyTorch ({parts})" if compiled >= 0.5 else parts


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
    return sorted(ranked, key=lambda r: (r.get("attribution") != OBSERVED, r["parent_ms"]))
