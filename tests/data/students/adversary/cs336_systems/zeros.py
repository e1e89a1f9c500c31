"""An attention that computes nothing: O and L are zeros, the gradients zeros. What the adversarial
adapters files try to get graded as correct."""

import torch


class ZerosAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        lse = torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, lse)
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None
