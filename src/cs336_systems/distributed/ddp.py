"""What every data-parallel wrapper of this package shares.

``DataParallel`` broadcasts rank 0's parameters and buffers at construction, delegates ``forward``,
and (for the overlapping variants) owns the post-accumulate-grad hooks with the guard against a
second gradient before ``finish_gradient_synchronization()``. A step, for every variant:

    ddp.on_train_batch_start(); loss_fn(ddp(x), y).backward(); ddp.finish_gradient_synchronization(); opt.step()

The subclasses import this module and never the other way round: the factory that builds them by
name, and so imports them all, is ``ddp_factory.make_ddp``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from cs336_systems.distributed.comm import (
    broadcast_module,
    parameter_names,
    require_process_group,
    world,
)


class DataParallel(nn.Module):
    """Base of ``NaiveDDP``, ``DDPIndividualParameters`` and ``DDPBucketed``; ``.module`` is the model."""

    def __init__(self, module: nn.Module):
        super().__init__()
        require_process_group(type(self).__name__)
        self.module = module
        self.world_size = world()[1]
        broadcast_module(module)
        self._names = parameter_names(module)
        self._seen: set[int] = set()  # parameters whose gradient arrived in this backward pass
        self._hooks: list[Any] = []

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        return self.module(*inputs, **kwargs)

    def _hook_gradients(self, params: list[nn.Parameter]) -> None:
        """Call ``_on_grad_ready(p)`` once a parameter's gradient of this backward is accumulated."""
        self._hooks = [p.register_post_accumulate_grad_hook(self._guarded_ready) for p in params]

    def _guarded_ready(self, param: torch.Tensor) -> None:
        if id(param) in self._seen:
            raise RuntimeError(
                f"parameter {self._names.get(id(param), '?')!r} got a second gradient before "
                "finish_gradient_synchronization(); call it after every backward pass"
            )
        self._seen.add(id(param))
        self._on_grad_ready(param)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        raise NotImplementedError

    def on_train_batch_start(self) -> None:
        """Per-step reset before the forward pass (a no-op unless a variant keeps per-step state)."""

    def finish_gradient_synchronization(self) -> None:
        raise NotImplementedError

    def remove_hooks(self) -> None:
        """Detach from the module (e.g. to wrap it again with another DDP variant)."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()


__all__ = ["DataParallel"]
