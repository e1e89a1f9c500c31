"""The handout's design: a Triton forward, a backward in PyTorch under torch.compile: ranked."""

from cs336_systems.designs import CompiledBackward as Triton


def get_flashattention_autograd_function_pytorch():
    raise NotImplementedError


def get_flashattention_autograd_function_triton():
    return Triton
