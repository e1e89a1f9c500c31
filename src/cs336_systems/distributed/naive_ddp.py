"""Naive data parallelism (D14) and its flat variant (D15): gradients are averaged only after the
whole backward pass, so every byte of communication adds to the step time.

- ``allreduce_gradients(params)``: one blocking all-reduce per gradient tensor (D14).
- ``allreduce_gradients(params, flat=True)``: the gradients flattened into one buffer per
  (device, dtype) and all-reduced in a single call (D15): fewer, larger calls.

``NaiveDDP`` wraps a module with the same interface as the overlapping wrappers, so the benches and
``cli/ddp_train.py`` swap them freely; the handout's "script" is that loop:

    model = NaiveDDP(ToyModel(), flat=False)        # broadcasts rank 0's weights
    for x, y in batches:                            # each rank: its shard of the global batch
        optimizer.zero_grad()
        loss_fn(model(x), y).backward()
        model.finish_gradient_synchronization()     # average gradients across ranks
        optimizer.step()
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from cs336_systems.distributed.comm import group_by_dtype_device, trainable_parameters, world
from cs336_systems.distributed.ddp import DataParallel


@torch.no_grad()
def allreduce_gradients(params: Sequence[torch.Tensor], flat: bool = False) -> int:
    """Average the ``.grad`` of ``params`` over all ranks, after backward; returns the number of
    all-reduce calls issued. Parameters whose grad is None are skipped, so such a parameter must get
    no gradient on every rank (as with torch DDP without ``find_unused_parameters``)."""
    _, world_size = world()
    grads = [p.grad for p in params if p.grad is not None]
    if world_size == 1 or not grads:
        return 0
    calls = 0
    if flat:
        for group in group_by_dtype_device(grads).values():
            buffer = _flatten_dense_tensors(group)
            dist.all_reduce(buffer)
            calls += 1
            buffer.div_(world_size)
            torch._foreach_copy_(group, _unflatten_dense_tensors(buffer, group))
    else:
        for grad in grads:
            dist.all_reduce(grad)
            calls += 1
        torch._foreach_div_(grads, world_size)
    return calls


class NaiveDDP(DataParallel):
    """Broadcasts rank 0's parameters and buffers at construction; ``finish_gradient_synchronization``
    all-reduces every gradient after backward (per tensor, or flattened when ``flat=True``)."""

    def __init__(self, module: nn.Module, flat: bool = False):
        super().__init__(module)
        self.flat = flat
        self._params = trainable_parameters(module)

    def finish_gradient_synchronization(self) -> None:
        allreduce_gradients(self._params, flat=self.flat)
