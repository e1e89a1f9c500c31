"""Trains a model data-parallel through the DDP hooks (1.0.5's per-parameter and bucketed, 2026's
``get_ddp``) on this rank's slice of the batches the judge gave, and returns what a reference run is
compared with: the wrapped module's parameters right after wrapping (rank 0's, if it broadcast), and
after every step the gradients the after-backward hook left and the parameters after the optimizer step.
"""

from __future__ import annotations

from typing import Any

import torch

from ..shared.cases import Case
from ..shared.models import loss_fn, make_model
from ..shared.training import detached, make_optimizer, rank_slice
from .hooks import Hooks


def run(hooks: Hooks, case: Case, inputs: dict, device: torch.device, rank: int) -> dict[str, Any]:
    names = case.hooks
    wrap, after = getattr(hooks, names[0]), getattr(hooks, names[1])
    local = make_model(case.model, case.dtype, inputs["init"][rank]).to(device)
    family = case.knob("family")
    ddp = wrap(local, case.knob("bucket_mb")) if family == "bucketed" else wrap(local)
    after_wrap = detached(list(ddp.module.parameters()) + list(ddp.module.buffers()))
    opt = make_optimizer(case.knob("optimizer"), ddp.parameters())
    world = case.world_size
    grads, params = [], []
    for step in range(case.knob("steps")):
        x, y, mask = (inputs[n][step] for n in ("x", "y", "mask"))
        opt.zero_grad(set_to_none=True)
        if family == "bucketed":
            getattr(hooks, names[2])(ddp, opt)
        xs, ys, ms = (rank_slice(t, rank, world).to(device) for t in (x, y, mask))
        ddp.module.use_extra = ms
        loss_fn(case.model, ddp(xs), ys).backward()
        after(ddp, opt)
        grads.append([None if p.grad is None else p.grad.detach().cpu().clone() for p in ddp.parameters()])
        opt.step()
        params.append(detached(list(ddp.parameters())))
    return {"after_wrap": after_wrap, "grads": grads, "params": params}
