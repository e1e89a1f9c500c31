"""Handout 1.1.5: the accumulation probe and the ToyModel whose dtypes show what autocast does."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

ACCUMULATION_VARIANTS = ("fp32", "fp16", "fp32+=fp16", "fp32+=fp16.float()")


def accumulation_probe(n: int = 1000, increment: float = 0.01) -> dict[str, float]:
    """Sum ``increment`` n times, four ways (handout mixed_precision_accumulation):
    fp32 accumulator and terms; fp16 accumulator and terms; fp32 accumulator with fp16 terms (implicit
    upcast by in-place add); fp32 accumulator with explicitly upcast fp16 terms."""
    results = {}
    for variant in ACCUMULATION_VARIANTS:
        acc_dtype = torch.float16 if variant == "fp16" else torch.float32
        term_dtype = torch.float32 if variant == "fp32" else torch.float16
        s = torch.tensor(0, dtype=acc_dtype)
        for _ in range(n):
            x = torch.tensor(increment, dtype=term_dtype)
            s += x.float() if variant.endswith(".float()") else x
        results[variant] = float(s)
    return results


def accumulation_errors(n: int = 1000, increment: float = 0.01) -> dict[str, float]:
    """|result - n·increment| per variant."""
    exact = n * increment
    return {k: abs(v - exact) for k, v in accumulation_probe(n, increment).items()}


class ToyModel(nn.Module):
    """The handout's ToyModel (benchmarking_mixed_precision (a))."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.fc1 = nn.Linear(in_features, 10, bias=False)
        self.ln = nn.LayerNorm(10)
        self.fc2 = nn.Linear(10, out_features, bias=False)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.relu(self.fc1(x))
        x = self.ln(x)
        x = self.fc2(x)
        return x


def toy_dtype_probe(
    device: torch.device | str,
    dtype: torch.dtype,
    batch: int = 4,
    in_features: int = 8,
    out_features: int = 5,
) -> dict[str, torch.dtype]:
    """One autocast(``dtype``) forward + loss and a backward outside autocast; returns the dtypes of
    the parameters (inside autocast), fc1's output, LayerNorm's output, the logits, the loss and the
    gradients. Parameters and gradients report one dtype if all agree, else raise."""
    device = torch.device(device)
    gen = torch.Generator().manual_seed(0)
    model = ToyModel(in_features, out_features).to(device)
    x = torch.randn(batch, in_features, generator=gen).to(device)
    y = torch.randint(0, out_features, (batch,), generator=gen).to(device)
    seen: dict[str, torch.dtype] = {}
    hooks = [
        model.fc1.register_forward_hook(lambda m, i, o: seen.__setitem__("fc1", o.dtype)),
        model.ln.register_forward_hook(lambda m, i, o: seen.__setitem__("ln", o.dtype)),
    ]
    try:
        with torch.autocast(device.type, dtype=dtype):
            seen["params"] = _one({p.dtype for p in model.parameters()}, "parameters")
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        seen["logits"], seen["loss"] = logits.dtype, loss.dtype
        loss.backward()
        seen["grads"] = _one({p.grad.dtype for p in model.parameters()}, "gradients")
    finally:
        for hook in hooks:
            hook.remove()
    return seen


def _one(dtypes: set[torch.dtype], what: str) -> torch.dtype:
    if len(dtypes) != 1:
        raise AssertionError(f"{what} have mixed dtypes {dtypes}")
    return dtypes.pop()
