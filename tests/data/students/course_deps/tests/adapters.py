from __future__ import annotations


def get_flashattention_autograd_function_pytorch() -> type:
    # imported here, as the course's template does: a hook's dependencies load when it is called
    from cs336_systems.flash_pytorch import FlashAttentionPyTorch

    return FlashAttentionPyTorch


def get_flashattention_autograd_function_triton() -> type:
    from cs336_systems.flash_triton import FlashAttentionTriton

    return FlashAttentionTriton
