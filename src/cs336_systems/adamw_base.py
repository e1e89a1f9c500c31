"""What every AdamW of the suite shares (:class:`AdamWBase`), below both that use it: the foreach AdamW of
``model/optim.py`` and the Triton ``FusedAdamW`` of ``kernels/fused_adamw.py``. A leaf module (torch
only), so that the kernels never import the model, which imports them."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch


class AdamWBase(torch.optim.Optimizer):
    """What every AdamW of the suite shares: argument checks, lazy state, and grouping a param group's
    tensors by step count (each bias correction stays exact when params were added or frozen later).
    Subclasses implement ``_update(params, step, group)`` over tensors of one step count."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter] | Iterable[dict],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
    ):
        if lr < 0:
            raise ValueError(f"invalid learning rate {lr}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"invalid betas {betas}")
        if eps < 0 or weight_decay < 0:
            raise ValueError(f"invalid eps {eps} or weight_decay {weight_decay}")
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    def _check_param(self, p: torch.Tensor, group_params: list[torch.Tensor]) -> None:
        """Hook for subclasses with stricter needs (dtype, device)."""

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            by_step: dict[int, list[torch.Tensor]] = {}
            for p in params:
                self._check_param(p, params)
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                by_step.setdefault(state["step"], []).append(p)
            for step, same_step in by_step.items():
                self._update(same_step, step, group)
        return loss

    def _update(self, params: list[torch.Tensor], step: int, group: dict) -> None:
        raise NotImplementedError
