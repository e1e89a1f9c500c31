"""One training step with its phases marked: the step body of the DDP / sharding benches
(``harness.train_step``) and of the 8B step (``training.step_8b``)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn

# The points ``train_step`` marks, in order: each phase runs from one to the next.
MARKS = ("start", "forward", "backward", "synced", "end")


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_fn: Callable[[], torch.Tensor],
    mark: Callable[[str], None] = lambda name: None,
    *,
    zero_grad_first: bool = False,
    before_step: Callable[[], object] | None = None,
) -> torch.Tensor:
    """Forward with loss (``loss_fn``), backward, the wrapper's gradient synchronization (ours wait for
    their last reduce-scatters / all-reduces here; torch's did inside backward), optimizer step.
    ``mark`` is called with each name of :data:`MARKS`. Gradients are set to None after the step, or
    before the forward with ``zero_grad_first`` (then they stay alive after the step, where the DDP
    benches measure the handout's memory points). ``before_step`` runs between synchronization and the
    step (gradient clipping)."""
    mark("start")
    if zero_grad_first:
        optimizer.zero_grad(set_to_none=True)
    loss = loss_fn()
    mark("forward")
    loss.backward()
    mark("backward")
    finish = getattr(model, "finish_gradient_synchronization", None)
    if finish is not None:
        finish()
    mark("synced")
    if before_step is not None:
        before_step()
    optimizer.step()
    if not zero_grad_first:
        optimizer.zero_grad(set_to_none=True)
    mark("end")
    return loss.detach()
