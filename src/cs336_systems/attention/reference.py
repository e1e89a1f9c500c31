"""Plain PyTorch attention (handout eq. 1), annotated with NVTX / profiler ranges, and its compiled twin."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

from cs336_systems.nvtx import annotate

# The handout's masking convention: masked scores get -1e6 added, not -inf, so a fully masked row stays finite.
MASK_BIAS = -1e6


def causal_mask(n_queries: int, n_keys: int, device: torch.device) -> torch.Tensor:
    """True where key j may be attended from query i (j <= i)."""
    q_idx = torch.arange(n_queries, device=device)[:, None]
    k_idx = torch.arange(n_keys, device=device)[None, :]
    return k_idx <= q_idx


def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, ranges: bool
) -> torch.Tensor:
    span = annotate if ranges else (lambda name: contextlib.nullcontext())
    with span("computing attention scores"):
        scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
        if is_causal:
            keep = causal_mask(q.shape[-2], k.shape[-2], q.device)
            scores = scores + torch.where(keep, 0.0, MASK_BIAS).to(scores.dtype)
    with span("computing softmax"):
        probs = torch.softmax(scores, dim=-1)
    with span("final matmul"):
        return probs @ v


@annotate("scaled dot product attention")
def scaled_dot_product_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    return _attention(q, k, v, is_causal, ranges=True)


def _unannotated_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False):
    # NVTX pushes would break the compiled graph; the compiled twin computes the same math without them.
    return _attention(q, k, v, is_causal, ranges=False)


compiled_scaled_dot_product_attention = torch.compile(_unannotated_attention)


def torch_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False) -> torch.Tensor:
    """torch's fused attention, for side-by-side comparison (backend chosen by torch unless pinned)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
