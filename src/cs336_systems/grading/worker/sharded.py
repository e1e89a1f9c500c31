"""Trains through ``get_sharded_optimizer(params, optimizer_cls, **kwargs)`` on the batches the judge
gave (the same on every rank), and returns the parameters after every step and the optimizer state this
rank holds, per parameter (found in the optimizer's ``.state`` and in that of any optimizer it holds).
The judge compares both with the unsharded optimizer's run: each parameter's state must sit on exactly
one rank and equal the unsharded state, so a claim of ownership is backed by the right numbers."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..shared.cases import Case
from ..shared.models import make_model
from ..shared.training import detached, held_optimizers, optimizer_params, optimizer_spec, sharded_loss
from .hooks import Hooks


def state_by_index(opt: torch.optim.Optimizer, model: nn.Module) -> dict[int, dict[str, torch.Tensor]]:
    index = {id(p): i for i, p in enumerate(model.parameters())}
    found: dict[int, dict[str, torch.Tensor]] = {}
    for inner in held_optimizers(opt):
        for param, state in inner.state.items():
            tensors = {k: v.detach().cpu().clone() for k, v in state.items() if isinstance(v, torch.Tensor)}
            if tensors and id(param) in index:
                found.setdefault(index[id(param)], {}).update(tensors)
    return found


def run(hooks: Hooks, case: Case, inputs: dict, device: torch.device, rank: int) -> dict[str, Any]:
    model = make_model(case.model, case.dtype, inputs["init"]).to(device)
    model.use_extra = torch.ones(case.knob("batch"), dtype=torch.bool, device=device)
    cls, kwargs = optimizer_spec(case.knob("optimizer"))
    opt = hooks.get_sharded_optimizer(optimizer_params(case, model), cls, **kwargs)
    params = []
    for step in range(case.knob("steps")):
        opt.zero_grad()
        sharded_loss(case, model, inputs["x"][step].to(device), inputs["y"][step].to(device)).backward()
        opt.step()
        params.append(detached(model.parameters()))
        if case.knob("add_after") == step:
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.03})
    return {"params": params, "state": state_by_index(opt, model)}
