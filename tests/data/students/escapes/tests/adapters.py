"""Tries every way out of its worker at import (``cs336_systems/escape.py``); its PyTorch attention is a
neighbour's where it can read one, zeros otherwise (it has none of its own)."""

from __future__ import annotations

import contextlib

import torch

from cs336_systems import escape

escape.break_out()


class ZerosAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        ctx.save_for_backward(q, k, v, torch.zeros(q.shape[:2], dtype=torch.float32, device=q.device))
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def get_flashattention_autograd_function_pytorch() -> type:
    found = None
    with contextlib.suppress(Exception):
        found = escape.neighbours_attention()
    return found or ZerosAttention


def get_flashattention_autograd_function_triton() -> type:
    raise NotImplementedError
