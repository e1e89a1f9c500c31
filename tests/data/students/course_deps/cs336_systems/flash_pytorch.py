"""FlashAttention-2 in PyTorch: key tiles with an online softmax forward, backward recomputed from the
logsumexp; the scores come from the student's cs336_basics (einx, jaxtyping)."""

import math

import torch
from cs336_basics.nn_utils import scores

TILE = 16


def backward(q, k, v, o, lse, is_causal, d_o):
    """dQ, dK, dV from the saved logsumexp (shared with the Triton forward)."""
    p = torch.exp(scores(q.float(), k.float(), is_causal) - lse[..., None])
    d_o = d_o.float()
    d_v = p.transpose(-1, -2) @ d_o
    d_p = d_o @ v.float().transpose(-1, -2)
    d_s = p * (d_p - (d_o * o).sum(-1, keepdim=True)) / math.sqrt(q.shape[-1])
    d_q, d_k = d_s @ k.float(), d_s.transpose(-1, -2) @ q.float()
    return d_q.to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype), None


class FlashAttentionPyTorch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        s = scores(q.float(), k.float(), is_causal)
        m = torch.full(s.shape[:-1], -math.inf, dtype=torch.float32, device=q.device)
        l_sum = torch.zeros_like(m)
        o = torch.zeros(*q.shape, dtype=torch.float32, device=q.device)
        for j in range(0, k.shape[-2], TILE):
            s_j = s[..., j : j + TILE]
            m_new = torch.maximum(m, s_j.amax(-1))
            p = torch.exp(s_j - m_new[..., None])
            scale = torch.exp(m - m_new)
            l_sum = scale * l_sum + p.sum(-1)
            o = scale[..., None] * o + p @ v[..., j : j + TILE, :].float()
            m = m_new
        o = o / l_sum[..., None]
        ctx.save_for_backward(q, k, v, o, m + torch.log(l_sum))
        ctx.is_causal = is_causal
        return o.to(q.dtype)

    @staticmethod
    def backward(ctx, d_o):
        return backward(*ctx.saved_tensors, ctx.is_causal, d_o)
