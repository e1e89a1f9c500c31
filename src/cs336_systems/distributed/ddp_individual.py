"""D16: data parallelism that overlaps communication with the backward pass, one gradient at a time.

Each trainable parameter gets a post-accumulate-grad hook, which fires once its gradient for this
backward pass is complete (once per backward even for a tied parameter used twice, since autograd
sums the uses before accumulating); the hook launches an async all-reduce of that gradient, so the
communication of late layers runs while autograd still computes the early ones.
``finish_gradient_synchronization()`` waits for the outstanding calls and averages.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.distributed.comm import trainable_parameters
from cs336_systems.distributed.ddp import DataParallel


class DDPIndividualParameters(DataParallel):
    """``DDPIndividualParameters(module)``: ``.module`` is the wrapped model; ``forward`` delegates.

    Frozen parameters (``requires_grad=False``) get no hook and are only broadcast at construction.
    A parameter that gets no gradient in a step is not communicated, so it must get none on every
    rank (the same contract as torch DDP without ``find_unused_parameters``); use ``DDPBucketed``
    when ranks may differ in which parameters they use.
    """

    def __init__(self, module: nn.Module):
        super().__init__(module)
        self._pending: list[tuple[dist.Work, torch.Tensor]] = []
        self._hook_gradients(trainable_parameters(module))

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        grad = param.grad
        self._pending.append((dist.all_reduce(grad, async_op=True), grad))

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for every all-reduce launched in this backward pass (on GPU: until it is queued
        ahead of later work on the current stream), then divide the sums by the world size."""
        for work, _ in self._pending:
            work.wait()
        if self._pending:
            torch._foreach_div_([grad for _, grad in self._pending], self.world_size)
        self._pending.clear()
        self._seen.clear()
