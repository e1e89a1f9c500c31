"""What a result row records about the machine it ran on: one ``device_name`` spelling for every bench
(the report names machines by it) and the library versions and matmul precision of the run."""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def device_name(device: torch.device | str) -> str:
    """``NVIDIA H200`` for a GPU, ``cpu (x86_64, 16 cores)`` for the host: the same text from every bench."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu ({platform.processor() or platform.machine()}, {os.cpu_count()} cores)"


def environment_info(device: torch.device | str) -> dict[str, Any]:
    """extra_info fields naming the machine and the numerics of a run (not called ``device``: the
    recording functions take that as their own argument)."""
    import triton

    return {
        "device_name": device_name(device),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "fp32_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
        "torch_threads": torch.get_num_threads(),  # CPU timings depend on it (see the root conftest.py)
    }
