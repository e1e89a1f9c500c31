"""Layers written like the course's classes (einsum ``Linear``, ``Embedding``, ``RMSNorm``), for the FSDP
tests and the FSDP checks where a student's ``cs336_basics.model`` has none: models whose sharding code
sees the course's parameter shapes and names.

``cast`` (None by default) runs a layer's matmul or lookup in a lower precision: the single-process
reference of a mixed-precision FSDP run sets it, so that both compute in the same dtype.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn


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
