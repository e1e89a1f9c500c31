"""Planted bug, attention family: the Triton backward computes dK with the causal mask off (the
probabilities P = exp(S - L) of masked keys are not zeroed in the dK pass). dQ, dV, O and L are
the suite's, so only the dK check may fail, and only in causal cases."""

from __future__ import annotations

import math

import torch

from tests.data.planted_common import SUITE, suite_hooks

globals().update(suite_hooks())
_Real = SUITE.get_flashattention_autograd_function_triton()


class CausalMaskOffInDK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, Q, K, V, is_causal=False):
        O = _Real.forward(ctx, Q, K, V, is_causal)  # saves what the suite's forward saves
        ctx.planted = (Q, K, V, O, is_causal)  # plain attributes: the saved tensors stay the suite's
        return O

    @staticmethod
    def backward(ctx, dO):
        dQ, dK, dV, *rest = _Real.backward(ctx, dO)
        Q, K, V, O, is_causal = ctx.planted
        if is_causal:
            (L,) = [t for t in ctx.saved_tensors if t.shape == Q.shape[:-1]]
            scale = 1 / math.sqrt(Q.shape[-1])
            q, k, v, o, do = (t.float() for t in (Q, K, V, O, dO))
            P = torch.exp(q @ k.transpose(-1, -2) * scale - L.float()[..., None])  # no mask
            dS = P * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
            dK = (dS.transpose(-1, -2) @ q * scale).to(K.dtype)
        return dQ, dK, dV, *rest


def get_flashattention_autograd_function_triton() -> type:
    return CausalMaskOffInDK
