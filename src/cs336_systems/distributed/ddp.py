"""What every data-parallel wrapper of this package shares, and the one factory that builds them by name.

``DataParallel`` broadcasts rank 0's parameters and buffers at construction, delegates ``forward``,
and (for the overlapping variants) owns the post-accumulate-grad hooks with the guard against a
second gradient before ``finish_gradient_synchronization()``. A step, for every variant:

    ddp.on_train_batch_start(); loss_fn(ddp(x), y).backward(); ddp.finish_gradient_synchronization(); opt.step()

``make_ddp(variant, module, bucket_size_mb)`` is used by the training-step harness and the
equivalence tests alike. ``bucket_size_mb`` is in MiB (``units.mb_to_bytes``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from cs336_systems.distributed.comm import (
    broadcast_module,
    parameter_names,
    require_process_group,
    trainable_parameters,
    world,
)

VARIANTS = ("naive", "flat", "individual", "bucketed")


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


def make_ddp(variant: str, module: nn.Module, bucket_size_mb: float | None = None) -> DataParallel:
    """The wrapper named ``variant``: naive (D14), flat (D15), individual (D16), bucketed (D17)."""
    from cs336_systems.distributed.ddp_bucketed import DDPBucketed
    from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
    from cs336_systems.distributed.naive_ddp import NaiveDDP

    if variant not in VARIANTS:
        raise ValueError(f"unknown DDP variant {variant!r}; choose one of {VARIANTS}")
    if (variant == "bucketed") != (bucket_size_mb is not None):
        raise ValueError(f"bucket_size_mb is required for 'bucketed' and only for it, got {bucket_size_mb}")
    if variant in ("naive", "flat"):
        return NaiveDDP(module, flat=variant == "flat")
    if variant == "individual":
        return DDPIndividualParameters(module)
    return DDPBucketed(module, bucket_size_mb=bucket_size_mb)


__all__ = ["VARIANTS", "DataParallel", "make_ddp", "trainable_parameters"]
