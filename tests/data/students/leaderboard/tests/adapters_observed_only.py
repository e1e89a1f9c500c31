"""The honest kernel whenever something observes the process, torch's SDPA behind a token kernel when
nothing does (the timed run)."""

from cs336_systems.tricks import OwnKernelOnlyWhenWatched as Triton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return Triton
