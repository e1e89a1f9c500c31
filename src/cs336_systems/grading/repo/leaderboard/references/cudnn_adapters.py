"""The leaderboard's cuDNN reference as an adapters file: the Triton hook answers torch's SDPA on its
cuDNN backend (on the course's (batch, seq, d) tensors as (1, batch, seq, d) views), differentiable by
autograd. Timed, never ranked: what runs is torch's attention, and the row is a reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


class CudnnAttention:
    @staticmethod
    def apply(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=is_causal)[0]


def get_flashattention_autograd_function_triton() -> type:
    return CudnnAttention
