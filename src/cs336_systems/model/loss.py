"""Cross-entropy from logits, numerically stable for large logits."""

from __future__ import annotations

import torch


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean over all positions of -log softmax(logits)[target]; logits (..., vocab), targets (...).

    Computed in fp32 with the max subtracted first, so logits around 1e4 neither overflow exp nor
    lose the target's logit to rounding.
    """
    if logits.shape[:-1] != targets.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} do not match")
    logits = logits.float()
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_normalizer = shifted.exp().sum(dim=-1).log()
    target_logit = shifted.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_normalizer - target_logit).mean()
