"""Pieces the training checks share, on both sides of the process boundary: the optimizers by name
(the student's run and the reference run build the same one), the optimizers a sharded optimizer holds,
the sharded optimizer's parameters and loss, a rank's slice of a global batch, and detached CPU copies
of what a run returns."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from .cases import Case

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


def held_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it holds as attributes (directly or in a list / dict): where a
    sharded optimizer keeps its state, whatever it calls the wrapped instance."""
    found = [optimizer]
    for value in vars(optimizer).values():
        if isinstance(value, dict):
            values = list(value.values())
        else:
            values = list(value) if isinstance(value, list | tuple) else [value]
        found += [v for v in values if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
    return found


def param_groups(model: nn.Module, kind: str) -> list:
    """Every trainable parameter but ``extra``'s (added later, or never); or two groups with options of
    their own (``groups``)."""
    if kind == "one-group":
        return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("extra")]
    return [
        {"params": list(model.fc1.parameters()), "lr": 0.02},
        {"params": [*model.ln.parameters(), *model.fc2.parameters()], "weight_decay": 0.0},
    ]


def optimizer_params(case: Case, model: nn.Module) -> Any:
    """What the hook is handed: the course hands over the generator ``model.parameters()`` itself;
    beyond, lists and groups (``param_groups``)."""
    if case.knob("params_as") == "generator":
        return model.parameters()
    return param_groups(model, case.knob("groups"))


def sharded_loss(case: Case, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = model(x)
    if case.knob("loss") == "sum-of-squares":
        return ((y - out) ** 2).sum()  # the course's loss
    return torch.nn.functional.mse_loss(out, y)
