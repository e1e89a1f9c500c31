"""An attention that fails with a network error's words: a rank that "lost its connection" was once the
machine's fault and left the case out of the score, whatever the code did."""

import torch


class BlamesNetwork(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        raise RuntimeError("[../third_party/gloo/transport/tcp/pair.cc:534] Connection reset by peer")


def get_flashattention_autograd_function_pytorch():
    return BlamesNetwork


def get_flashattention_autograd_function_triton():
    return BlamesNetwork
