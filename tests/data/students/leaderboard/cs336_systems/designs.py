"""The honest kernel's forward with other backwards: the handout's own design (a backward in PyTorch
under ``torch.compile``), which ranks, and two that borrow torch's attention in the backward, which do
not. Written for the suite's grading tests."""

import math

import torch
import torch.nn.functional as F

from cs336_systems import flash


@torch.compile(dynamic=False)
def compiled_backward(q, k, v, o, lse, d_o, is_causal: bool):
    """FlashAttention-2's backward from L (the handout's equations 13-19), in PyTorch, compiled."""
    scale = 1 / math.sqrt(q.shape[-1])
    s = (q @ k.transpose(-1, -2)).float() * scale
    if is_causal:
        n = q.shape[1]
        s = torch.where(torch.ones(n, n, dtype=torch.bool, device=q.device).tril(), s, -1e6)
    p = torch.exp(s - lse[..., None])
    dv = p.to(d_o.dtype).transpose(-1, -2) @ d_o
    dp = (d_o @ v.transpose(-1, -2)).float()
    ds = p * (dp - (o.float() * d_o.float()).sum(-1, keepdim=True)) * scale
    return ds.to(q.dtype) @ k, ds.to(q.dtype).transpose(-1, -2) @ q, dv


class _TritonForward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = flash.forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o


class CompiledBackward(_TritonForward):
    """The handout's design: Triton forward, compiled PyTorch backward."""

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        return (*compiled_backward(q, k, v, o, lse, d_o.contiguous(), ctx.is_causal), None)


class SdpaBackward(_TritonForward):
    """Triton forward; the backward recomputes through torch's SDPA and takes its gradients."""

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, _, _ = ctx.saved_tensors
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*(t[:, None] for t in leaves), is_causal=ctx.is_causal)[:, 0]
        return (*torch.autograd.grad(o, leaves, d_o), None)


class SdpaBackwardOp(_TritonForward):
    """Triton forward; the backward calls the SDPA flash backend's backward operator itself."""

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, _, _ = ctx.saved_tensors
        q4, k4, v4, g4 = (t[:, None] for t in (q, k, v, d_o.contiguous()))
        scale = 1 / math.sqrt(q.shape[-1])
        out = torch.ops.aten._scaled_dot_product_flash_attention(
            q4, k4, v4, 0.0, ctx.is_causal, False, scale=scale
        )
        o4, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = out
        grads = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            g4, q4, k4, v4, o4, lse, cum_q, cum_k, max_q, max_k, 0.0, ctx.is_causal, seed, offset, scale=scale
        )
        return (*(g[:, 0] for g in grads), None)
