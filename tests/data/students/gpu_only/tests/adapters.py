from __future__ import annotations


def get_flashattention_autograd_function_pytorch() -> type:
    raise NotImplementedError


def get_flashattention_autograd_function_triton() -> type:
    from cs336_systems.flash_triton import FlashAttentionTriton

    return FlashAttentionTriton
