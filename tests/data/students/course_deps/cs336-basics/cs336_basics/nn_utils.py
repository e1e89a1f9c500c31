"""Attention scores the way the course's cs336_basics writes its layers: einx for the contraction,
jaxtyping for the shapes (both imported at module level, as the course's model.py does)."""

import math

import einx
import torch
from jaxtyping import Bool, Float
from torch import Tensor


def scores(q: Float[Tensor, "b q d"], k: Float[Tensor, "b k d"], is_causal: bool) -> Float[Tensor, "b q k"]:
    s = einx.dot("b q d, b k d -> b q k", q, k) / math.sqrt(q.shape[-1])
    if is_causal:
        later: Bool[Tensor, "q k"] = (
            torch.arange(k.shape[-2], device=q.device)[None, :]
            > torch.arange(q.shape[-2], device=q.device)[:, None]
        )
        s = s + later * -1e6
    return s
