"""Gradient clipping by the global norm for the 8B step's plain optimizer step (the leaderboard step
clips nothing; with ``StepOptions.grad_clip`` set, the optimizer-in-backward falls back to this)."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.distributed.fsdp import FSDP


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float) -> torch.Tensor:
    """Scale every gradient by min(1, max_norm / (norm + 1e-6)), ``norm`` the global L2 norm of the
    whole model's gradient; returns ``norm``. Ours FSDP: the shards' squared sums are all-reduced
    (padding rows carry zero gradients) and the replicated gradients, equal on every rank, are added
    once. FSDP2 (DTensor gradients) and unsharded models: ``torch.nn.utils.clip_grad_norm_``."""
    if not isinstance(model, FSDP):
        params = [p for p in model.parameters() if p.grad is not None]
        return torch.nn.utils.clip_grad_norm_(params, max_norm)
    sharded = [p.grad for unit in model.unit_shards() for p in unit if p.grad is not None]
    replicated = [p.grad for p in model.replicated_parameters() if p.grad is not None]
    device = (sharded or replicated)[0].device
    total = torch.zeros((), dtype=torch.float32, device=device)
    for g in sharded:
        total += g.float().square().sum()
    if dist.is_initialized():
        dist.all_reduce(total)
    for g in replicated:
        total += g.float().square().sum()
    norm = total.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for g in sharded + replicated:
        g.mul_(scale.to(g.dtype))
    return norm
