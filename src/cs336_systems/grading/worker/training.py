"""Pieces the training checks share, on both sides of the process boundary: the optimizers by name
(the student's run and the reference run build the same one), a rank's slice of a global batch, and
detached CPU copies of what a run returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

# name -> (optimizer class name in torch.optim, keyword arguments)
OPTIMIZERS: dict[str, tuple[str, dict[str, Any]]] = {
    "sgd": ("SGD", {"lr": 0.1}),  # no momentum or decay: a parameter without gradient stays put
    "sgd-momentum": ("SGD", {"lr": 0.1, "momentum": 0.9}),
    "sgd-0.01": ("SGD", {"lr": 0.01}),
    "adamw": ("AdamW", {"lr": 0.05, "weight_decay": 0.1}),
    "adamw-0.01": ("AdamW", {"lr": 0.01, "weight_decay": 0.1}),
    "adamw-course": ("AdamW", {"lr": 0.1, "weight_decay": 0.1, "betas": (0.9, 0.999), "eps": 1e-8}),
}


def optimizer_spec(name: str) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    cls, kwargs = OPTIMIZERS[name]
    return getattr(torch.optim, cls), dict(kwargs)


def make_optimizer(name: str, params: Iterable) -> torch.optim.Optimizer:
    cls, kwargs = optimizer_spec(name)
    return cls(params, **kwargs)


def rank_slice(t: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    """This rank's equal slice of a global batch (dimension 0), as the course slices it."""
    if t.shape[0] % world_size:
        raise ValueError(f"batch {t.shape[0]} does not divide over {world_size} ranks")
    n = t.shape[0] // world_size
    return t[rank * n : (rank + 1) * n]


def detached(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    return [t.detach().cpu().clone() for t in tensors]
