"""The traced route: ``torch.library.triton_op`` bodies under torch.compile. Inductor traces into the op,
bakes the tuned block-pointer configs into its own generated code and launches the kernels from there, so
a compiled step runs none of our Python per call (short, host-bound cases: the model at short context)."""

from __future__ import annotations

import torch

from . import compat
from .configs import KERNELS, TileConfig
from .launch import dkdv_launch, dq_launch, fwd_launch
from .plan import AttentionPlan, Launcher, new_output, pick, record, tune_space
from .select import Case, Layouts, resolve
from .settings import INTERPRET, flash_settings
from .triton_bwd import flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
from .triton_fwd import flash_fwd_kernel
from .tuner import TUNER

# The kernels the traced route launches, whose mutation analysis torch then runs once per signature instead
# of per call site and pass (49 s of the compiled xl step's cold start, analysis_memo.py).
TRACED_KERNELS = (flash_fwd_kernel, flash_bwd_dq_kernel, flash_bwd_dkdv_kernel)


def _traced_launch(launch) -> None:
    """Launch through ``wrap_triton``, with the analysis memo in front of torch's analysis (installed by
    the first traced launch; idempotent)."""
    compat.install_analysis_memo(TRACED_KERNELS)
    launch.traced()


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A real tensor with ``t``'s shape, strides, dtype and device, N(0, 1) values (under tracing ``t`` is
    fake; the tuner times real launches)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_()


def tune_ahead(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launcher: Launcher
) -> None:
    """Tune ``launcher``'s configs of all three kernels for this case on real tensors of the same layout,
    outside any tracing mode, while a graph is compiled: a traced launch bakes its config into the compiled
    graph, so the choice must exist when the graph is traced; a graphed one would otherwise tune in the
    CUDA graph's warm-up run, with the model's memory in use."""
    batch, heads, n_q, d = q.shape
    case = (batch * heads, n_q, k.shape[2], d, is_causal, q.dtype)
    spaces = [tune_space(kernel, launcher, case) for kernel in KERNELS]
    if (
        not flash_settings().autotune
        or INTERPRET
        or all(TUNER.lookup(*space) is not None for space in spaces)
    ):
        return  # (a key chosen before, or in the shipped table, compiles nothing here)
    with compat.no_dispatch_modes(), torch.no_grad():
        qr, kr, vr = (_real_like(t) for t in (q, k, v))
        plan = AttentionPlan(qr, kr, vr, is_causal, launcher)
        o, lse = plan.forward(qr, kr, vr)
        plan.backward(qr, kr, vr, o, torch.randn_like(o), lse)


def _traced_config(kernel: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> TileConfig:
    """The block-pointer config :func:`tune_ahead` chose (or the default, with tuning off), as
    :func:`select.resolve` lets it run (a forced descriptor or Gluon config: its tiles by block pointers,
    recorded with the reason)."""

    def untuned(c: TileConfig) -> None:
        raise RuntimeError(f"{kernel}: traced configs are tuned by tune_ahead, before tracing launches")

    batch, heads, n_q, d = q.shape
    case = Case(batch * heads, n_q, k.shape[2], d, is_causal, q.dtype)
    # The traced route's gate refuses every feature that reads tensor facts, so none are needed.
    choice = resolve(kernel, pick(kernel, "traced", case, untuned), case, Layouts(False, {}), "traced")
    record(case, "traced", {kernel: choice}, False)
    return choice.config


def flash_forward_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """``flash_forward`` for a ``triton_op`` body: tuned block-pointer configs, launched by ``wrap_triton``."""
    tune_ahead(q, k, v, is_causal, "traced")
    o = new_output(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    _traced_launch(fwd_launch(_traced_config("fwd", q, k, is_causal), is_causal, q, k, v, o, lse))
    return o, lse


def flash_backward_traced(q, k, v, o, do, lse, is_causal: bool):
    """``flash_backward`` for a ``triton_op`` body."""
    tune_ahead(q, k, v, is_causal, "traced")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    _traced_launch(
        dq_launch(_traced_config("dq", q, k, is_causal), is_causal, q, k, v, o, do, lse, delta, dq)
    )
    _traced_launch(
        dkdv_launch(_traced_config("dkdv", q, k, is_causal), is_causal, q, k, v, do, lse, delta, dk, dv)
    )
    return dq, dk, dv
