from __future__ import annotations

import torch

from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    return DDPIndividualParameters(module)


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp_model.finish_gradient_synchronization()


def get_sharded_optimizer(
    params, optimizer_cls: type[torch.optim.Optimizer], **kwargs
) -> torch.optim.Optimizer:
    return ShardedOptimizer(params, optimizer_cls, **kwargs)
