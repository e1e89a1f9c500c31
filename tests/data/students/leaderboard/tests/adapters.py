"""The honest kernel: ranked."""

from cs336_systems.flash import FlashAttention as Triton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return Triton
