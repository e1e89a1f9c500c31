"""An attention that, graded beside other repositories, connects to every listening port it can find
(``cs336_systems.neighbours``): their rendezvous stores and gloo pairs on a shared network. It then fails,
its message saying which ports it saw and reached."""

import torch
from cs336_systems.neighbours import reach_all


class ReachesNeighbours(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        raise RuntimeError(f"neighbours: {reach_all()}")


def get_flashattention_autograd_function_pytorch():
    return ReachesNeighbours


def get_flashattention_autograd_function_triton():
    return ReachesNeighbours
