"""The same implementation with a planted bug: dQ 1% off whenever n_queries != n_keys."""

from __future__ import annotations

from cs336_systems.flash import FlashAttention


class FlashAttentionDQBug(FlashAttention):
    @staticmethod
    def backward(ctx, d_o):
        FlashAttention.DQ_SCALE_IF_RECTANGULAR = 1.01
        return FlashAttention.backward(ctx, d_o)


def get_flashattention_autograd_function_pytorch() -> type:
    return FlashAttentionDQBug
