"""D22(a): activation checkpointing strategies for a stack of N identical blocks, as numbers.

Units: memory in block inputs (one residual-stream tensor, batch · seq · d_model elements); a block's own
saved activations are ``block_activations`` such units. Compute in block forwards (a backward costs about
two forwards, so a step without checkpointing is ~3N forwards).

- none: all N blocks' activations live at the peak: N · c (O(N) memory, no recomputation).
- single level, segments of k blocks: the ceil(N/k) segment inputs stay, and one segment's k blocks are
  live at a time while it is recomputed: ceil(N/k) + k·c, minimal near k = √(N/c): O(√N) memory for one
  extra forward per block (O(N) compute, ~4/3 of the step).
- nested (recursive halving, ``model/checkpointing.py``): one stored input per level of the recursion,
  ceil(log2 N) + 1, plus one block's activations: O(log N) memory; each block is recomputed once per
  checkpoint that encloses it, ~log2 N times: O(N log N) compute. Torch's non-reentrant checkpoint stops
  a recomputation as soon as the tensors it needs exist, so the measured count is at most this.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CheckpointPlan:
    strategy: str  # the ModelConfig.checkpoint policy
    n_blocks: int
    stored_inputs: int  # block inputs held at the peak of backward (an upper bound for "nested")
    live_blocks: int  # blocks whose own activations are held at once at the peak
    extra_block_forwards: int  # recomputed block forwards per step (an upper bound for "nested")
    memory_order: str  # asymptotic peak activation memory in N
    compute_order: str  # asymptotic forward+backward compute in N

    def peak_units(self, block_activations: float) -> float:
        """Peak activation memory in block inputs, given a block's saved activations in those units."""
        return self.stored_inputs + self.live_blocks * block_activations

    def compute_ratio(self, backward_over_forward: float = 2.0) -> float:
        """Step compute relative to no checkpointing (backward = ``backward_over_forward`` forwards)."""
        base = self.n_blocks * (1.0 + backward_over_forward)
        return (base + self.extra_block_forwards) / base


def _require_blocks(n_blocks: int) -> None:
    if n_blocks < 1:
        raise ValueError(f"need at least one block, got {n_blocks}")


def no_checkpointing(n_blocks: int) -> CheckpointPlan:
    _require_blocks(n_blocks)
    return CheckpointPlan("none", n_blocks, 0, n_blocks, 0, "N", "N")


def single_level(n_blocks: int, k: int) -> CheckpointPlan:
    _require_blocks(n_blocks)
    if k < 1:
        raise ValueError(f"segment length must be >= 1, got {k}")
    k = min(k, n_blocks)
    return CheckpointPlan(f"every:{k}", n_blocks, math.ceil(n_blocks / k), k, n_blocks, "sqrt(N)", "N")


def nested_recompute_count(n_blocks: int) -> int:
    """Block forwards recomputed by recursive halving: a segment of n > 1 blocks wraps each half in a
    checkpoint (+1 recompute for each of its n blocks) and recurses; W(1) = 0, W(n) = n + W(⌊n/2⌋) + W(⌈n/2⌉)."""
    if n_blocks <= 1:
        return 0
    half = n_blocks // 2
    return n_blocks + nested_recompute_count(half) + nested_recompute_count(n_blocks - half)


def nested(n_blocks: int) -> CheckpointPlan:
    _require_blocks(n_blocks)
    if n_blocks == 1:  # one block: plain per-block checkpointing
        return CheckpointPlan("nested", 1, 1, 1, 1, "log(N)", "N log N")
    depth = math.ceil(math.log2(n_blocks))
    return CheckpointPlan(
        "nested", n_blocks, depth + 1, 1, nested_recompute_count(n_blocks), "log(N)", "N log N"
    )


def best_single_level(n_blocks: int, block_activations: float) -> CheckpointPlan:
    """The segment length with the smallest peak (the √N strategy; ties go to the longer segment, which
    launches fewer checkpoints)."""
    plans = [single_level(n_blocks, k) for k in range(1, n_blocks + 1)]
    return min(plans, key=lambda p: (p.peak_units(block_activations), -p.live_blocks))


@dataclass(frozen=True)
class D22a:
    n_blocks: int
    sqrt_n: CheckpointPlan  # the memory-optimal single level at c = 1
    log_n: CheckpointPlan  # recursive halving


def d22a(n_blocks: int, block_activations: float = 1.0) -> D22a:
    return D22a(n_blocks, best_single_level(n_blocks, block_activations), nested(n_blocks))
