"""Fast and wrong: dK and dV never computed (fails the course tier)."""

from cs336_systems.tricks import WrongButFast as Triton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return Triton
