"""AdamW (Loshchilov & Hutter), decoupled weight decay, written to equal ``torch.optim.AdamW``."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch


class AdamW(torch.optim.Optimizer):
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
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            for p in params:
                if not self.state[p]:
                    self.state[p].update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
            self._update(group, params)
        return loss

    def _update(self, group: dict, params: list[torch.Tensor]) -> None:
        # One foreach kernel per stage over the whole group instead of a handful per tensor: the
        # xl model has ~500 tensors, so per-tensor launches would dominate the optimizer step.
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        grads = [p.grad for p in params]
        states = [self.state[p] for p in params]
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        for s in states:
            s["step"] += 1
        # Params of one group usually share a step count; bucket by it so late-added ones stay exact.
        by_step: dict[int, list[int]] = {}
        for i, s in enumerate(states):
            by_step.setdefault(s["step"], []).append(i)
        for step, idx in by_step.items():
            ps = [params[i] for i in idx]
            gs = [grads[i] for i in idx]
            ms = [exp_avgs[i] for i in idx]
            vs = [exp_avg_sqs[i] for i in idx]
            torch._foreach_mul_(ps, 1.0 - lr * wd)
            torch._foreach_lerp_(ms, gs, 1.0 - beta1)
            torch._foreach_mul_(vs, beta2)
            torch._foreach_addcmul_(vs, gs, gs, value=1.0 - beta2)
            bias1 = 1.0 - beta1**step
            bias2_sqrt = math.sqrt(1.0 - beta2**step)
            denom = torch._foreach_sqrt(vs)
            torch._foreach_div_(denom, bias2_sqrt)
            torch._foreach_add_(denom, eps)
            torch._foreach_addcdiv_(ps, ms, denom, value=-lr / bias1)
