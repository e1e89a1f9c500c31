"""Planted bug, DDP family: after the suite's synchronization every gradient is multiplied by the
world size, i.e. the gradients are summed over ranks instead of averaged (all three DDP hooks)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from tests.data.planted_common import SUITE, suite_hooks

globals().update(suite_hooks())


@torch.no_grad()
def _summed(ddp_model: torch.nn.Module) -> None:
    for p in ddp_model.parameters():
        if p.grad is not None:
            p.grad.mul_(dist.get_world_size())


def ddp_individual_parameters_on_after_backward(ddp_model, optimizer) -> None:
    SUITE.ddp_individual_parameters_on_after_backward(ddp_model, optimizer)
    _summed(ddp_model)


def ddp_bucketed_on_after_backward(ddp_model, optimizer) -> None:
    SUITE.ddp_bucketed_on_after_backward(ddp_model, optimizer)
    _summed(ddp_model)


def ddp_on_after_backward(ddp_model, optimizer) -> None:
    SUITE.ddp_on_after_backward(ddp_model, optimizer)
    _summed(ddp_model)
