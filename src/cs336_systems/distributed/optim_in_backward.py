"""The optimizer step inside the backward, on the suite's FSDP (issue 50).

:class:`OptimizerInBackward` holds one optimizer per FSDP unit (over that unit's fp32 shards) and one
over the replicated parameters. FSDP calls ``on_unit_grads(index)`` as soon as a unit's reduce-scatter
has been waited on and its averaged shard gradients are set; the unit's optimizer steps right there
and its gradients are dropped, so a rank holds the gradient shards of a few units at a time (those
whose reduce-scatters are in flight) instead of all of them (4 B/param/world: 16 GB per GPU at 8B on
2 GPUs, at the end of the backward). The replicated parameters (norm gains) are all-reduced in
``finish_gradient_synchronization``; they step in :meth:`OptimizerInBackward.step`, after it.

Same parameters as the plain step, bitwise: AdamW is elementwise, so updating a unit's tensors in one
call gives each element the same arithmetic as updating every tensor in one call; each parameter
keeps its own step count (bias corrections), and every optimizer sees the same hyperparameters
(``param_groups`` lists the inner optimizers' groups, so a learning-rate schedule that writes
``group["lr"]`` reaches them all). Not supported, by construction: gradient clipping (it needs the
global norm of every gradient before any step: the 8B step falls back to the plain step and says so)
and gradient accumulation over several backwards (each backward is a step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from cs336_systems.distributed.fsdp import FSDP

MakeOptimizer = Callable[[list[nn.Parameter]], Any]


class OptimizerInBackward:
    """See the module docstring. ``make(params)`` builds one optimizer (e.g. FusedAdamW) over a list
    of parameters; it is called once per unit with trainable shards and once for the replicated ones."""

    def __init__(self, fsdp: FSDP, make: MakeOptimizer):
        if fsdp.on_unit_grads is not None:
            raise ValueError("this FSDP already has an on_unit_grads callback")
        self._by_unit: dict[int, Any] = {i: make(ps) for i, ps in enumerate(fsdp.unit_shards()) if ps}
        replicated = fsdp.replicated_parameters()
        self._replicated = make(replicated) if replicated else None
        self.stepped_in_backward = 0  # unit steps taken inside backward / synchronization (tests, logs)
        fsdp.on_unit_grads = self._on_unit_grads

    @property
    def optimizers(self) -> list[Any]:
        return [*self._by_unit.values(), *([self._replicated] if self._replicated is not None else [])]

    @property
    def param_groups(self) -> list[dict]:
        return [g for opt in self.optimizers for g in opt.param_groups]

    @torch.no_grad()
    def _on_unit_grads(self, index: int) -> None:
        opt = self._by_unit.get(index)
        if opt is None:  # a unit of frozen weights
            return
        opt.step()
        opt.zero_grad(set_to_none=True)  # the point: the gradient shard is freed now
        self.stepped_in_backward += 1

    @torch.no_grad()
    def step(self) -> None:
        """After ``finish_gradient_synchronization``: the replicated parameters' step (their gradients
        are final only once all-reduced there). Every unit has stepped already."""
        if self._replicated is not None:
            self._replicated.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)
