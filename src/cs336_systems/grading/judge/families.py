"""Each hook family's judge by name: the inputs a case is given (drawn here from the run's seed), where
its reference runs, and the verdict on its workers' validated records. One module per family beside
this one (``attention``, ``training`` for DDP and the sharded optimizer, ``fsdp``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ..shared.cases import COURSE_PLACEMENT, Case
from ..verdict import Verdict
from . import attention, fsdp, training

MAKERS = {
    "attention": attention.make_inputs,
    "ddp": training.make_ddp_inputs,
    "sharded": training.make_sharded_inputs,
    "fsdp": fsdp.make_inputs,
}


def make_inputs(case: Case, seed: int) -> dict[str, Any]:
    """The case's inputs, drawn from ``seed`` (fresh for every run unless the grader asks for one)."""
    gen = torch.Generator().manual_seed(seed)
    return MAKERS[case.family](case, gen)


def reference_device(case: Case, on_gpu: bool) -> torch.device:
    """Where the reference runs: where the worker ran the case (the course's placement on a GPU host),
    so that both compute with the same kernels."""
    placed_on_gpu = case.device in ("cuda", COURSE_PLACEMENT)
    return torch.device("cuda", 0) if on_gpu and placed_on_gpu else torch.device("cpu")


def judge(case: Case, inputs: dict, payloads: list[dict], roots: list[Path], on_gpu: bool) -> Verdict:
    """The case's verdict from every rank's validated output record (status ``done``)."""
    device = reference_device(case, on_gpu)
    if case.family == "attention":
        return attention.judge(case, inputs, payloads[0], roots, device)
    if case.family == "fsdp":
        return fsdp.judge(case, inputs, payloads, device)
    return (training.judge_ddp if case.family == "ddp" else training.judge_sharded)(
        case, inputs, payloads, device
    )
