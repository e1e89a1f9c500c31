from cs336_systems.flash_triton import FlashAttentionTriton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return FlashAttentionTriton
