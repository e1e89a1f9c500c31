"""The parent's clock over work the parent verifies: the leaderboard row's time, measured here.

The timing worker warms up in the graded process, says ready, and waits. This process then starts its
clock and, in the same instant, writes the round's seed (fresh from ``secrets``) and iteration count;
the worker runs the iterations on inputs drawn from that seed (``shared/clock.py``) and hands back their
fingerprints; the clock stops when the fingerprints arrive. The graded process cannot start early (it
does not know the inputs), cannot stop the clock early (the clock stops on the results, which need the
work), and cannot skip, cache, precompute or scale iterations: after the clock has stopped, every
iteration's fingerprints are compared with the reference's (torch's SDPA on the same inputs, here).

Round 0 is short (``ClockPlan.calibration`` iterations): its time sets round 1's count so that round 1
lasts about ``target_ms``; the row's time is the last round's, per iteration.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ...exchange import Untrusted, tensor
from ...limits import Limits
from ...shared.cases import LEADERBOARD_CASE
from ...shared.clock import FIELDS, go_file, iterations, ready_file, result_name, wait_for

# |got - ref| <= TOLERANCE x the reference's projected norm, per fingerprint. bf16 rounding of a correct
# kernel moves a fingerprint by about 1e-2 of that norm (random signs: the errors add as a random walk); a
# wrong, skipped or stale iteration moves it by about the norm itself.
TOLERANCE = 0.1


@dataclass
class ClockPlan:
    rounds: int = 2
    calibration: int = 3  # round 0's iterations (the only round of an observed run)
    target_ms: float = 2000.0  # how long each later round should run
    min_iterations: int = 5
    max_iterations: int = 400
    # for the worker's warm-up (compiling, autotuning) and each round: the repository's share for it
    wait_s: float = field(default_factory=lambda: Limits().leaderboard_wait_s)

    def files(self) -> tuple[str, ...]:
        return tuple(f"ready.{r}" for r in range(self.rounds))

    def records(self) -> tuple[str, ...]:
        return tuple(result_name(r) for r in range(self.rounds))


@dataclass
class Round:
    seed: int
    iterations: int
    seconds: float


@dataclass
class ClockRun:
    """What the conversation saw: each round's seed, count and wall time on this process's clock."""

    rounds: list[Round] = field(default_factory=list)
    problem: str | None = None


def conversation(plan: ClockPlan) -> Callable[[Path, Callable[[], bool]], ClockRun]:
    """The parent's side, run by ``runner`` beside the timing worker."""

    def talk(folder: Path, alive: Callable[[], bool]) -> ClockRun:
        run = ClockRun()
        out, inputs = folder / "out", folder / "inputs"
        count = plan.calibration
        for round_ in range(plan.rounds):
            if not wait_for(ready_file(out, round_), plan.wait_s, alive):
                run.problem = f"the worker was never ready for round {round_}"
                return run
            seed = secrets.randbits(62)
            result = out / f"{result_name(round_)}.rank0.pt"
            started = time.perf_counter()
            _publish(go_file(inputs, round_), {"seed": seed, "iterations": count})
            if not wait_for(result, plan.wait_s, alive):
                run.problem = f"round {round_} never handed back its results"
                return run
            run.rounds.append(Round(seed, count, time.perf_counter() - started))
            per_iteration_ms = run.rounds[-1].seconds * 1e3 / count
            count = max(
                plan.min_iterations, min(plan.max_iterations, round(plan.target_ms / per_iteration_ms))
            )
        return run

    return talk


def _publish(path: Path, order: dict) -> None:
    """Written whole under another name, then renamed: the worker sees all of it or nothing."""
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(json.dumps(order))
    os.replace(partial, path)


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """The reference: torch's SDPA (its fastest backend here) on the course's (batch, seq, d) tensors,
    masked as the leaderboard's case is."""
    import torch.nn.functional as F

    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=LEADERBOARD_CASE.causal)[0]


def verify(
    fingerprints: Any,
    round_: Round,
    shape: tuple[int, int, int],
    device: torch.device,
    dtype: str = LEADERBOARD_CASE.dtype,
) -> str | None:
    """Why a round's fingerprints are not its iterations' (None when every one matches the reference)."""
    try:
        got = tensor(fingerprints, f"round {round_.seed:x}", (round_.iterations, 4, shape[0]), torch.float32)
    except Untrusted as exc:
        return str(exc)
    ref = iterations(sdpa, round_.seed, round_.iterations, shape, device, dtype, scales=True)
    bound = TOLERANCE * ref[:, 1]
    off = (got - ref[:, 0]).abs() > bound
    if not bool(off.any()):
        return None
    bad_iterations = sorted({int(i) for i in off.nonzero()[:, 0]})
    which = sorted({FIELDS[int(f)] for f in off.nonzero()[:, 1]})
    return (
        f"{len(bad_iterations)} of {round_.iterations} timed iterations do not match the reference "
        f"(first: iteration {bad_iterations[0]}; {', '.join(which)} off by more than {TOLERANCE:g} of their "
        "norm): the timed work was not the asked-for attention on the parent's inputs"
    )


def per_iteration_ms(run: ClockRun) -> float | None:
    if not run.rounds:
        return None
    last = run.rounds[-1]
    ms = last.seconds * 1e3 / last.iterations
    return ms if math.isfinite(ms) and ms > 0 else None
