"""Activation checkpointing policies for a stack of blocks (non-reentrant ``torch.utils.checkpoint``).

- ``"none"``: every block keeps its activations for backward.
- ``"every:K"``: segments of K consecutive blocks; a segment keeps only its input and recomputes its
  blocks' activations in backward. N/K segment inputs plus one segment's activations at a time: the
  √N strategy at K ≈ √N. ``"every:1"`` checkpoints each block.
- ``"keep:N"`` (N >= 0): the last N blocks run plainly (they keep all their activations), every other
  block is checkpointed on its own as in ``"every:1"``; ``"keep:0"`` is ``"every:1"`` and N >= the
  number of blocks is ``"none"``. Spare memory buys back the last blocks' re-run forwards.
- ``"nested"``: recursive halving (both halves checkpointed, down to single blocks): ~log2 N stored
  inputs plus one block's activations, at ~log2 N extra forward passes (``accounting.checkpointing``).

Non-reentrant checkpointing recomputes through the modules' ``__call__``, so forward pre-hooks (FSDP's
all-gathers) fire again during recomputation, and it nests, which ``"nested"`` needs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

import torch
from torch.utils.checkpoint import checkpoint

GRAMMAR = (
    "'none', 'every:K' (K >= 1 consecutive blocks per segment), 'keep:N' (N >= 0 last blocks not "
    "checkpointed, the others each checkpointed) or 'nested'"
)
_POLICY = re.compile(r"(every|keep):([0-9]+)")

Block = Callable[[torch.Tensor], torch.Tensor]


def parse_checkpoint(policy: str) -> tuple[str, int]:
    """``"none"`` -> ("none", 0); ``"every:K"`` -> ("every", K); ``"keep:N"`` -> ("keep", N);
    ``"nested"`` -> ("nested", 0)."""
    if policy in ("none", "nested"):
        return policy, 0
    match = _POLICY.fullmatch(policy) if isinstance(policy, str) else None
    if match is None or (match.group(1) == "every" and int(match.group(2)) < 1):
        raise ValueError(f"invalid checkpoint policy {policy!r}; expected {GRAMMAR}")
    return match.group(1), int(match.group(2))


def checkpointed_blocks(policy: str, n_blocks: int) -> list[bool]:
    """Which of ``n_blocks`` blocks are each checkpointed on their own under a per-block ``policy``
    (``"none"``, ``"every:1"`` or ``"keep:N"``); the others run plainly.

    ``keep:N`` leaves the *last* N blocks plain. Backward consumes activations in reverse order, so
    the last blocks' activations are alive for the shortest time: they are freed first, at the start
    of backward, before the gradients (and, under FSDP, the gradient shards) have grown; the first
    blocks' would stay alive through the whole backward and add to its peak. Their re-run would also
    be the first thing backward does, so skipping it shortens the critical path at once.
    """
    kind, k = parse_checkpoint(policy)
    if kind == "none":
        return [False] * n_blocks
    if kind == "keep":
        return [i < n_blocks - k for i in range(n_blocks)]
    if kind == "every" and k == 1:
        return [True] * n_blocks
    raise ValueError(f"checkpoint policy {policy!r} is not per-block; expected 'none', 'every:1' or 'keep:N'")


def _run(blocks: Sequence[Block], x: torch.Tensor) -> torch.Tensor:
    for block in blocks:
        x = block(x)
    return x


def _nested(blocks: Sequence[Block], x: torch.Tensor) -> torch.Tensor:
    """Checkpoint each half, recursing inside it; a single block is run as is (its caller wrapped it)."""
    if len(blocks) == 1:
        return blocks[0](x)
    mid = len(blocks) // 2
    x = checkpoint(_nested, blocks[:mid], x, use_reentrant=False)
    return checkpoint(_nested, blocks[mid:], x, use_reentrant=False)


def run_blocks(blocks: Sequence[Block], x: torch.Tensor, policy: str) -> torch.Tensor:
    """Apply ``blocks`` in order under a checkpointing ``policy``. Without autograd (no_grad, or nothing
    requires a gradient) there is nothing to save, so the blocks simply run."""
    kind, k = parse_checkpoint(policy)
    if kind == "none" or not torch.is_grad_enabled() or not blocks:
        return _run(blocks, x)
    if kind == "nested":
        if len(blocks) == 1:
            return checkpoint(blocks[0], x, use_reentrant=False)
        return _nested(list(blocks), x)
    if kind == "keep":
        for block, checkpointed in zip(blocks, checkpointed_blocks(policy, len(blocks)), strict=True):
            x = checkpoint(block, x, use_reentrant=False) if checkpointed else block(x)
        return x
    for start in range(0, len(blocks), k):
        x = checkpoint(_run, blocks[start : start + k], x, use_reentrant=False)
    return x
