"""Named points inside one training step, for the split of its time into phases."""

from __future__ import annotations

import time
from typing import Any

import torch


class StepMarks:
    """Named points of a step: CUDA events on a GPU (recording one costs no host sync), the host clock
    on the CPU. Read them (``ms``) after the step's final device synchronize."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: dict[str, Any] = {}

    def mark(self, name: str) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points[name] = event
        else:
            self.points[name] = time.perf_counter()

    def ms(self, a: str, b: str) -> float:
        """Milliseconds from point ``a`` to point ``b``."""
        if self.cuda:
            return self.points[a].elapsed_time(self.points[b])
        return (self.points[b] - self.points[a]) * 1e3
