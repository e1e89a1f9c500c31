"""An attention that leaves the process with exit code 0 in the middle of its first call."""

import os

import torch


class LeavesEarly(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        os._exit(0)


def get_flashattention_autograd_function_pytorch():
    return LeavesEarly


def get_flashattention_autograd_function_triton():
    return LeavesEarly
