"""A 'Triton' FlashAttention that, like many students' kernels, refuses CPU tensors with a bare
assert before launching; its math is plain PyTorch (the grading tests run it only on the CPU)."""

import math

import torch


class FlashAttentionTriton(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        assert q.is_cuda
        s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        p = torch.softmax(s, dim=-1)
        ctx.save_for_backward(q, k, v, torch.logsumexp(s, -1))
        return p @ v

    @staticmethod
    def backward(ctx, d_o):
        raise RuntimeError("not reached on the CPU")
