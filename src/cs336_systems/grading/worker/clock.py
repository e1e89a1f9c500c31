"""The worker's side of one round of the parent's clock (the protocol and the iterations themselves are
``shared/clock.py``, which the judge runs too)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch

from ..shared.clock import go_file, iterations, ready_file, result_name, wait_for


def serve_round(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    round_: int,
    job: dict,
    shape: tuple[int, int, int],
    device: torch.device,
    dtype: str,
    timeout_s: float,
    observed: bool = False,
) -> None:
    """The worker's side of one round: say ready, wait for the parent's seed, run, hand back."""
    out, inputs = Path(job["out"]), Path(job["inputs"])
    ready_file(out, round_).touch()
    go = go_file(inputs, round_)
    if not wait_for(go, timeout_s):
        raise TimeoutError(f"the parent never started round {round_}")
    order = json.loads(go.read_text())
    seed, count = int(order["seed"]), int(order["iterations"])
    prints = iterations(call, seed, count, shape, device, dtype, observed=observed)
    rank = int(os.environ.get("RANK", "0"))
    name = result_name(round_)
    partial = out / f".{name}.partial"
    torch.save({"token": job["token"], "case": name, "rank": rank, "fingerprints": prints}, partial)
    partial.rename(out / f"{name}.rank{rank}.pt")
