"""Input checks shared by the Triton launchers."""

from __future__ import annotations

import os

import torch

# Triton reads TRITON_INTERPRET when a kernel is decorated, so what counts is its value at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


def require_triton_device(device: torch.device, what: str) -> None:
    """Triton kernels run on CUDA tensors, or on CPU tensors under the interpreter only."""
    if device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"{what} needs CUDA tensors (got {device}); set TRITON_INTERPRET=1 before importing "
            "cs336_systems to run it on the CPU"
        )
