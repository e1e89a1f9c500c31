"""Planted bug, FSDP family: after the suite's reduce-scatter the sharded weights' gradients are
multiplied by the world size, i.e. summed over ranks instead of averaged."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.data.planted_common import SUITE, suite_hooks

globals().update(suite_hooks())


@torch.no_grad()
def fsdp_on_after_backward(fsdp_model, optimizer) -> None:
    SUITE.fsdp_on_after_backward(fsdp_model, optimizer)
    for p in fsdp_model.parameters():
        if p.grad is not None and p.dim() > 1:  # the Linear / Embedding weights, sharded
            p.grad.mul_(dist.get_world_size())
