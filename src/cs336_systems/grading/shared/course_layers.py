"""Layers written like the course's classes (einsum ``Linear``, ``Embedding``, ``RMSNorm``), for the FSDP
tests and the FSDP checks where a student's ``cs336_basics.model`` has none: models whose sharding code
sees the course's parameter shapes and names. ``probe_layers`` runs a set of such classes on the judge's
probe inputs: the worker on the student's classes, the judge on these (its reference).

``cast`` (None by default) runs a layer's matmul or lookup in a lower precision: the single-process
reference of a mixed-precision FSDP run sets it, so that both compute in the same dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from .dtypes import DTYPES


class Linear(nn.Module):
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / math.sqrt(d_in))
        self.cast: torch.dtype | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.cast is None else self.weight.to(self.cast)
        return torch.einsum("...i,oi->...o", x if self.cast is None else x.to(self.cast), w)


class Embedding(nn.Module):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(num, dim))
        self.cast: torch.dtype | None = None

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.weight if self.cast is None else self.weight.to(self.cast))[ids]


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)


def load_parameters(module: nn.Module, tensors: list[torch.Tensor]) -> list[str]:
    """Copy ``tensors`` into ``module``'s parameters in order; the parameters' names. Raises when the
    structure differs (another count or shape than the course's layers have)."""
    named = list(module.named_parameters())
    shapes = [tuple(p.shape) for _, p in named]
    if shapes != [tuple(t.shape) for t in tensors]:
        raise ValueError(
            f"{type(module).__name__} has parameters {[(n, s) for (n, _), s in zip(named, shapes, strict=True)]}; "
            f"the course's layers have shapes {[tuple(t.shape) for t in tensors]}"
        )
    with torch.no_grad():
        for (_, p), t in zip(named, tensors, strict=True):
            p.copy_(t)
    return [n for n, _ in named]


def probe_layers(layers: tuple[type, type, type], probe: dict) -> dict[str, torch.Tensor]:
    """Each layer's output and gradients on the judge's inputs (fp32; RMSNorm also on fp16 input)."""
    linear_cls, embedding_cls, norm_cls = layers
    out: dict[str, torch.Tensor] = {}
    linear = linear_cls(*probe["linear_w"].shape[::-1])
    load_parameters(linear, [probe["linear_w"]])
    x = probe["linear_x"].clone().requires_grad_()
    y = linear(x)
    y.backward(probe["linear_dy"])
    out |= {"linear_y": y, "linear_dx": x.grad, "linear_dw": linear.weight.grad}
    embedding = embedding_cls(*probe["embedding_w"].shape)
    load_parameters(embedding, [probe["embedding_w"]])
    e = embedding(probe["ids"])
    e.backward(probe["embedding_dy"])
    out |= {"embedding_y": e, "embedding_dw": embedding.weight.grad}
    norm = norm_cls(probe["norm_w"].shape[0])
    load_parameters(norm, [probe["norm_w"]])
    for dtype in ("fp32", "fp16"):
        x = probe["norm_x"].to(DTYPES[dtype]).clone().requires_grad_()
        y = norm(x)
        y.backward(probe["norm_dy"].to(y.dtype))
        out |= {f"norm_{dtype}_y": y, f"norm_{dtype}_dx": x.grad}
    return {k: v.detach().cpu().clone() for k, v in out.items()}
