"""The course's blank adapters template, release 1.0.5 (stanford-cs336/assignment2-systems): every
hook raises NotImplementedError. Rebuilt here from the hook names and signatures of that release
(SPEC.md); the contract tests must skip every test against it, naming the hook."""

from __future__ import annotations

import torch


def get_flashattention_autograd_function_pytorch() -> type:
    raise NotImplementedError


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError


def get_ddp_individual_parameters(module: torch.nn.Module) -> torch.nn.Module:
    raise NotImplementedError


def ddp_individual_parameters_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    raise NotImplementedError


def get_ddp_bucketed(module: torch.nn.Module, bucket_size_mb: float) -> torch.nn.Module:
    raise NotImplementedError


def ddp_bucketed_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    raise NotImplementedError


def ddp_bucketed_on_train_batch_start(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer):
    raise NotImplementedError


def get_sharded_optimizer(
    params, optimizer_cls: type[torch.optim.Optimizer], **kwargs
) -> torch.optim.Optimizer:
    raise NotImplementedError
