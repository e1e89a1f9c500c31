"""The iterations the parent's clock times and the files the two sides exchange: the same code on both
sides of the process boundary (the worker's side of a round is ``worker/clock.py``).

The graded process runs ``iterations`` with its attention; the judging process runs it again with a
reference attention and compares. Each iteration draws its own inputs (the course's one leaf
``randn(3, *shape)``, unpacked into q, k, v) from a generator seeded with a number the graded process
learns only when the parent starts its clock, runs ``call(q, k, v).sum().backward()`` as the course's
protocol does, and reduces what came out to a fingerprint: per batch row, the dot product of dQ, dK, dV
and O with a projection drawn from the same generator. A fingerprint costs one fused pass over each
tensor; it cannot be produced without the iteration's outputs, so an iteration skipped, cached,
precomputed or computed on other inputs fails the parent's comparison (``repo/leaderboard/clock.py``).

The protocol between the two processes, through files in the job's folder: the worker writes
``out/ready.<round>`` when it is warm and waits for ``inputs/go.<round>.json`` (``{"seed", "iterations"}``,
written by the parent at the moment its clock starts); it then runs the iterations and writes
``out/clock.<round>.rank0.pt`` (the fingerprints and the run's token) by an atomic rename; the parent's
clock stops when that file appears. This module imports only torch, the standard library and
``shared/``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .cases import LEADERBOARD_CASE
from .dtypes import DTYPES

POLL_S = 0.0002  # the parent's and the worker's poll of each other's files: far below one iteration
FIELDS = ("dq", "dk", "dv", "o")


def draw(gen: torch.Generator, shape: tuple[int, ...], device: torch.device, dtype: str) -> torch.Tensor:
    return torch.randn(shape, generator=gen, device=device, dtype=DTYPES[dtype])


def iterations(
    call: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor],
    seed: int,
    count: int,
    shape: tuple[int, int, int],
    device: torch.device,
    dtype: str = LEADERBOARD_CASE.dtype,
    scales: bool = False,
    observed: bool = False,
) -> torch.Tensor:
    """``(count, 4, batch)`` fp32 fingerprints (dQ, dK, dV, O per batch row) of ``count`` iterations,
    each on fresh inputs from ``seed``; with ``scales``, ``(count, 2, 4, batch)``: the fingerprints and
    the norm of each projected tensor (the judge's yardstick of rounding, computed on the reference).
    O's fingerprint is taken as soon as the call returns: O must be whole by the end of the forward (an O
    filled in later, in the backward, fails it). ``observed``: each call, then its backward, alone between
    ``cudaProfilerStart`` and ``Stop``, which an observer started with ``--profile-from-start off`` records
    (process-wide: the backward's kernels are launched from autograd's own thread), each range opened by
    a marker kernel so that the observer tells the phases apart; drawing the inputs and the other
    fingerprints stay outside."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    proj = draw(gen, shape, device, dtype)
    out = torch.empty((count, 2 if scales else 1, 4, shape[0]), device=device, dtype=torch.float32)
    for i in range(count):
        leaf = draw(gen, (3, *shape), device, dtype).requires_grad_()
        q, k, v = leaf
        with _profiled(observed):
            o = call(q, k, v)
            o_print = o.detach() * proj
            out[i, 0, 3] = o_print.sum(dim=(-2, -1), dtype=torch.float32)
        total = o.sum()
        with _profiled(observed):
            total.backward()
        grads = leaf.grad * proj
        out[i, 0, :3] = grads.sum(dim=(-2, -1), dtype=torch.float32)
        if scales:
            out[i, 1, :3] = grads.float().square().sum(dim=(-2, -1)).sqrt()
            out[i, 1, 3] = o_print.float().square().sum(dim=(-2, -1)).sqrt()
    return (out if scales else out[:, 0]).cpu()


@contextlib.contextmanager
def _profiled(on: bool) -> Iterator[None]:
    if not on:
        yield
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        torch.cuda._sleep(0)  # the phase marker (``observer.PHASE_MARKER``): the range's first kernel
        yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.profiler.stop()


def ready_file(out: Path, round_: int) -> Path:
    return out / f"ready.{round_}"


def go_file(inputs: Path, round_: int) -> Path:
    return inputs / f"go.{round_}.json"


def result_name(round_: int) -> str:
    return f"clock.{round_}"


def wait_for(path: Path, timeout_s: float, alive: Callable[[], bool] = lambda: True) -> bool:
    """Whether ``path`` appeared within ``timeout_s`` (the other side polls on: ``alive`` says whether
    it is still there to write it)."""
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if not alive() or time.monotonic() > deadline:
            return path.exists()
        time.sleep(POLL_S)
    return True
