"""Activation checkpointing policies for a stack of blocks (non-reentrant ``torch.utils.checkpoint``).

- ``"none"``: every block keeps its activations for backward.
- ``"every:K"``: segments of K consecutive blocks; a segment keeps only its input and recomputes its
  blocks' activations in backward. N/K segment inputs plus one segment's activations at a time: the
  √N strategy at K ≈ √N. ``"every:1"`` checkpoints each block.
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

GRAMMAR = "'none', 'every:K' (K >= 1 consecutive blocks per segment) or 'nested'"
_EVERY = re.compile(r"every:([0-9]+)")

Block = Callable[[torch.Tensor], torch.Tensor]


def parse_checkpoint(policy: str) -> tuple[str, int]:
    """``"none"`` -> ("none", 0); ``"every:K"`` -> ("every", K); ``"nested"`` -> ("nested", 0)."""
    if policy in ("none", "nested"):
        return policy, 0
    match = _EVERY.fullmatch(policy) if isinstance(policy, str) else None
    if match is None or int(match.group(1)) < 1:
        raise ValueError(f"invalid checkpoint policy {policy!r}; expected {GRAMMAR}")
    return "every", int(match.group(1))


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
    for start in range(0, len(blocks), k):
        x = checkpoint(_run, blocks[start : start + k], x, use_reentrant=False)
    return x
