from __future__ import annotations

import torch
from cs336_systems.flash import FlashAttention


def get_flashattention_autograd_function_pytorch() -> type:
    return FlashAttention


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError


def get_ddp(module: torch.nn.Module) -> torch.nn.Module:
    raise NotImplementedError


def ddp_on_after_backward(ddp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError


def get_sharded_optimizer(
    params, optimizer_cls: type[torch.optim.Optimizer], **kwargs
) -> torch.optim.Optimizer:
    raise NotImplementedError


def get_fsdp(module: torch.nn.Module, compute_dtype: torch.dtype | None = None) -> torch.nn.Module:
    raise NotImplementedError


def fsdp_on_after_backward(fsdp_model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    raise NotImplementedError


def fsdp_gather_full_params(fsdp_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    raise NotImplementedError
