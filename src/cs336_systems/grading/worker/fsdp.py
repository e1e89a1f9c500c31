"""Runs 2026's FSDP hooks (``get_fsdp(module, compute_dtype)``, ``fsdp_on_after_backward``,
``fsdp_gather_full_params``) on the course's FSDP model, built from the student's own ``cs336_basics.model``
layers (as the course's test builds it, and as students' ``get_fsdp`` picks what to shard by
``isinstance``; the suite's course-like layers where they have none), with the judge's initial weights.

Returned for the judge: the layers' outputs on the judge's probe inputs (the judge's reference uses the
course's layer math, so it checks that the student's layers compute it), and per check:
- ``train``: after every step the gathered full parameters and each local parameter's dtype, shape and
  gradient; the local element count of every parameter after wrapping (is it sharded).
- ``grad-sync``: one ``out.sum().backward()`` on this rank's own data: every parameter's gradient.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..shared import course_layers
from ..shared.cases import Case
from ..shared.course_layers import load_parameters, probe_layers
from ..shared.dtypes import DTYPES
from ..shared.models import LayersModel
from ..shared.training import make_optimizer, rank_slice
from .hooks import Hooks

# The ``compute_dtype`` the hook is handed: for fp32 None (the adapter's default: no cast asked for), not
# torch.float32, which is why this is not the shared map.
COMPUTE_DTYPES = {"fp32": None, "fp16": DTYPES["fp16"], "bf16": DTYPES["bf16"]}


def layer_classes() -> tuple[tuple[type, type, type], str]:
    """(Linear, Embedding, RMSNorm) and where they come from: the student's ``cs336_basics.model``, or
    the suite's course-like layers when there is none."""
    try:
        from cs336_basics.model import Embedding, Linear, RMSNorm
    except ImportError:
        return (course_layers.Linear, course_layers.Embedding, course_layers.RMSNorm), "suite"
    return (Linear, Embedding, RMSNorm), "cs336_basics.model"


def _param_facts(fsdp: nn.Module) -> dict[str, Any]:
    facts = {}
    for name, p in fsdp.module.named_parameters():
        facts[name] = {
            "dtype": str(p.dtype).removeprefix("torch."),
            "shape": list(p.shape),
            "requires_grad": p.requires_grad,
            "grad": None if p.grad is None else p.grad.detach().cpu().clone(),
        }
    return facts


def run(hooks: Hooks, case: Case, inputs: dict, device: torch.device, rank: int) -> dict[str, Any]:
    torch.use_deterministic_algorithms(True)  # as the course's FSDP tests run
    layers, source = layer_classes()
    result: dict[str, Any] = {"layers_from": source, "probe": probe_layers(layers, inputs["probe"])}
    model = LayersModel(layers, *case.knob("sizes"))
    result["names"] = load_parameters(model, inputs["init"])
    model = model.to(device)
    world = case.world_size
    with warnings.catch_warnings():
        warnings.simplefilter(
            "ignore"
        )  # the rank processes of the course's tests do not turn them into errors
        fsdp = hooks.get_fsdp(model, compute_dtype=COMPUTE_DTYPES[case.dtype])
        result["local_numel"] = {n: p.numel() for n, p in fsdp.module.named_parameters()}
        opt = make_optimizer(case.knob("optimizer"), fsdp.parameters())
        if case.knob("check") == "grad-sync":
            fsdp(inputs["ids"][rank].to(device)).sum().backward()
            hooks.fsdp_on_after_backward(fsdp, opt)
            result["facts"] = _param_facts(fsdp)
            return result
        result["steps"] = []
        for step in range(case.knob("steps")):
            ids, targets = (rank_slice(inputs[n][step], rank, world).to(device) for n in ("ids", "targets"))
            opt.zero_grad(set_to_none=True)
            out = fsdp(ids)
            F.cross_entropy(out[:, -1].float(), targets).backward()
            hooks.fsdp_on_after_backward(fsdp, opt)
            facts = _param_facts(fsdp)
            opt.step()
            gathered = hooks.fsdp_gather_full_params(fsdp)
            full = {n: t.detach().cpu().clone() for n, t in dict(gathered).items()}
            result["steps"].append(
                {"facts": facts, "gathered": full, "out_dtype": str(out.dtype).removeprefix("torch.")}
            )
    return result
