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
- keep:N (D26, the 8B step): the last N blocks are not checkpointed. In bytes, for the driver's
  per-block checkpointing with attention's output kept: :func:`block_activation_bytes`,
  :func:`step_memory` (``StepMemory.peak(N)``) and :func:`blocks_to_keep` (the largest N under a memory budget).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


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


# -- keep:N, in bytes (D26) ---------------------------------------------------------------------------


class BlockShape(Protocol):  # a ModelConfig, without importing the model package here
    d_model: int
    d_ff: int
    num_layers: int
    vocab_size: int


def block_activation_bytes(config: BlockShape, tokens: int, compiled: bool, compute_bytes: int = 2) -> int:
    """Bytes one plain (un-checkpointed) block holds for backward, ``tokens`` = batch · seq per GPU.

    With u = tokens · d_model and f = tokens · d_ff elements in the compute dtype:

    - eager, 14u + 4f: each RMSNorm saves its fp32 input copy and fp32 normalized tensor (2 · 2u each,
      8u), the two norm outputs feed matmuls (2u), attention keeps q, k (after RoPE), v and its output
      (4u; the QKV projection's output and the head-merge are then views or freed), SwiGLU keeps w1's
      and w3's outputs, silu(w1) and the product (4f).
    - compiled (the block's forward under ``torch.compile``), 8u + 3f: the partitioner recomputes the
      pointwise work in backward, so the norms keep only their bf16 inputs (2u) next to their outputs
      (2u), attention the same 4u, SwiGLU w1's and w3's outputs and the product w2 needs (3f).

    8B at 32,768 tokens, bf16: eager 6.19 GiB, compiled 4.02 GiB; the lost earlier attempt measured
    +6.20 and +4.02 GiB of peak per un-checkpointed block.
    """
    u, f = tokens * config.d_model, tokens * config.d_ff
    if compiled:
        return (8 * u + 3 * f) * compute_bytes
    fp32_norms = 2 * 2 * u * 4  # two norms, two fp32 tensors each (8u in bf16 units)
    return fp32_norms + (2 * u + 4 * u + 4 * f) * compute_bytes


def checkpointed_block_bytes(
    config: BlockShape, tokens: int, save_attention: bool, compute_bytes: int = 2
) -> int:
    """Bytes a checkpointed block keeps: its input, and attention's output when it is kept (the
    log-sum-exp, tokens · heads fp32, is left out: 0.4% of it at 8B)."""
    return tokens * config.d_model * compute_bytes * (2 if save_attention else 1)


@dataclass(frozen=True)
class StepMemory:
    """Predicted peak per GPU of the FSDP step (fp32 master weights, gradients and Adam state
    sharded over ``world_size``; bf16 compute), at the start of backward, where it peaks: every
    checkpointed block's kept tensors and the kept blocks' activations are alive, no block gradient
    shard exists yet (they are created as backward goes), and the LM head's backward holds its full
    fp32 weight gradient and gathered bf16 weight next to the embedding's full fp32 gradient buffer."""

    states: int  # fp32 parameters + Adam moments, this rank's shards
    head: int  # LM-head / embedding full buffers at the start of backward
    checkpointed: int  # per checkpointed block (its input, attention's output)
    block: int  # per plain block (every activation it saves)
    n_blocks: int
    # The end of backward, the other candidate for the peak: every fp32 gradient shard is alive
    # (``grads``; 0 when the optimizer steps inside the backward and frees each unit's shard) next to
    # the embedding's full fp32 gradient (``tail``), the activations gone. It binds only when the
    # activations are small (short context, many GPUs); at 8B / 32k tokens the start binds.
    grads: int = 0
    tail: int = 0

    def start_of_backward(self, keep: int) -> int:
        """With the last ``keep`` blocks plain. Under every:1 one block's activations are alive
        again while the last block is re-run; a plain last block needs no re-run, but its saved
        activations count the same, so that term stays (an upper bound by one block for keep >= 1)."""
        keep = max(0, min(keep, self.n_blocks))
        return self.states + self.head + (self.n_blocks - keep) * self.checkpointed + (keep + 1) * self.block

    def end_of_backward(self) -> int:
        return self.states + self.grads + self.tail

    def peak(self, keep: int) -> int:
        """Peak with the last ``keep`` blocks plain: the larger of the two candidates. In between,
        each block's backward frees its activations (or kept tensors) and adds its gradient shard
        (none in-backward), so the peak is at one end."""
        return max(self.start_of_backward(keep), self.end_of_backward())


def step_memory(
    config: BlockShape,
    n_params: int,
    tokens: int,
    world_size: int,
    compiled: bool,
    save_attention: bool = True,
    optimizer_in_backward: bool = False,
) -> StepMemory:
    """:class:`StepMemory` of the D26 step; 8B, 32,768 tokens per GPU, 2 GPUs: every:1 predicted
    72.2 GiB compiled / 74.4 eager (against the measured peaks: docs/perf-notes.md, D26). The end of
    backward there: 62.9 GiB with the plain step, 47.7 with the optimizer inside the backward."""
    head = config.vocab_size * config.d_model * (4 + 2 + 4)
    return StepMemory(
        states=n_params * (4 + 8) // world_size,
        head=head,
        checkpointed=checkpointed_block_bytes(config, tokens, save_attention),
        block=block_activation_bytes(config, tokens, compiled),
        n_blocks=config.num_layers,
        grads=0 if optimizer_in_backward else n_params * 4 // world_size,
        tail=config.vocab_size * config.d_model * 4,
    )


def blocks_to_keep(memory: StepMemory, budget_bytes: float) -> int:
    """The largest N (0..n_blocks) whose predicted peak fits ``budget_bytes``; 0 if none does (every:1
    is then the best there is)."""
    fits = [n for n in range(memory.n_blocks + 1) if memory.peak(n) <= budget_bytes]
    return max(fits, default=0)
