"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two launches,
no atomics). ``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch
backward of :mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) with any strides
(passed to the kernels as they are: no copies), with n_queries != n_keys.

Under torch.compile, the path depends on size and on CUDA graphs. Small cases (the model at short context: host-bound, ~10 µs of
GPU work per launch) go through ``torch.library.triton_op``: inductor traces into the op, bakes the
tuned block-pointer config and launches the kernels from its own generated code, so a compiled step runs
none of our Python per call. Compiled for CUDA graphs (``mode="reduce-overhead"``), the same small
cases go through the opaque ops with "graphed" plans instead (tuned by device time while compiling, any
config): the graph records their launchers once and replays the kernels. Large cases go through the
opaque ops whose launchers tune at first run and may use tensor descriptors (TMA), which pay off there. In eager
mode the call signature's plan (:class:`kernels.flash_attention.AttentionPlan`) launches the kernels:
inputs are checked when a signature is first seen, and later calls cost a few allocations and the
launches (a custom op's Python dispatch would cost more than the launch itself, and the model calls
attention 2 x layers times per step). Under a Python dispatch mode the forward goes through its op
(selective checkpointing keeps its output by op).
"""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from cs336_systems.attention.flash_pytorch import (
    check_attention_inputs,
    check_is_causal,
    compiled_flash_backward,
)
from cs336_systems.kernels import flash_attention as kernels
from cs336_systems.kernels.flash_attention import as_4d

INTERPRET = kernels.INTERPRET
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = kernels.MAX_HEAD_DIM


@torch.library.custom_op("cs336_systems::flash_attention_fwd", mutates_args=())
def _flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, graphed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.flash_forward(q, k, v, is_causal, "graphed" if graphed else "eager")


@_flash_fwd_op.register_fake
def _(q, k, v, is_causal, graphed=False):
    return kernels.new_output(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336_systems::flash_attention_bwd", mutates_args=())
def _flash_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
    graphed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels.flash_backward(q, k, v, o, do, lse, is_causal, "graphed" if graphed else "eager")


@_flash_bwd_op.register_fake
def _(q, k, v, o, do, lse, is_causal, graphed=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Up to this many batch·heads·n_q·n_k·d (the xl model at ctx 512 is 1.7e9, (4, 16, 1024, 1024, 128) 8.6e9),
# compiled graphs launch the kernels themselves (traced path). Larger cases are GPU-bound and keep the
# custom ops, whose tuner may pick TMA configs.
TRACED_MAX_WORK = 1 << 33


def _cuda_graphed() -> bool:
    """Whether the graph being compiled will be replayed from CUDA graphs (``mode="reduce-overhead"``:
    inductor's ``triton.cudagraphs``, set while the graph is lowered, which is when a triton_op's body
    is traced into it)."""
    from torch._inductor import config

    return bool(config.triton.cudagraphs)


# A triton_op's body is traced into the compiled graph. Under CUDA graphs it emits the opaque op instead,
# with graphed plans: a replay pays no launcher's host time, so the kernels may be the ones that cost more
# host time and less device time (tensor descriptors, Gluon), which the traced launches cannot use. In
# the compiled xl model (H100) the traced kernels took 4.33 ms per step, cuDNN's 4.23 and the graphed ones
# 3.97 (docs/perf-notes.md, session 14).
@torch.library.triton_op("cs336_systems::flash_attention_fwd_traced", mutates_args=())
def _flash_fwd_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if _cuda_graphed():
        kernels.tune_ahead(q, k, v, is_causal, "graphed")
        return _flash_fwd_op(q, k, v, is_causal, True)
    return kernels.flash_forward_traced(q, k, v, is_causal)


@torch.library.triton_op("cs336_systems::flash_attention_bwd_traced", mutates_args=())
def _flash_bwd_traced(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if _cuda_graphed():
        kernels.tune_ahead(q, k, v, is_causal, "graphed")
        return _flash_bwd_op(q, k, v, o, do, lse, is_causal, True)
    return kernels.flash_backward_traced(q, k, v, o, do, lse, is_causal)


def _traced(q: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether a compiled graph should launch this case's kernels itself (small, on the GPU: under
    Triton's CPU interpreter ``wrap_triton`` returns the plain kernel, which cannot be traced)."""
    batch, heads, n_q, d = q.shape
    return q.is_cuda and batch * heads * n_q * k.shape[2] * d <= TRACED_MAX_WORK


def _check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: object) -> None:
    check_attention_inputs(q, k, v)
    check_is_causal(is_causal)
    if q.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton FlashAttention needs CUDA tensors (got {q.device}); to run it on the CPU set "
            "TRITON_INTERPRET=1 before importing cs336_systems"
        )
    d = q.shape[-1]
    if not MIN_HEAD_DIM <= d <= MAX_HEAD_DIM:
        raise ValueError(
            f"head dim {d} not supported by the Triton kernels: need {MIN_HEAD_DIM} <= d <= {MAX_HEAD_DIM}"
        )


def _fwd_via_op(Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool):
    """The forward through a custom op, on 4-D views: while compiling (small cases traced into the graph,
    large ones opaque), or under a Python dispatch mode (selective activation checkpointing,
    FlopCounterMode), which then sees one attention op that it can keep or count."""
    _check_triton_inputs(Q, K, V, is_causal)
    q, k, v = as_4d(Q), as_4d(K), as_4d(V)
    if torch.compiler.is_compiling():
        op = _flash_fwd_traced if _traced(q, k) else _flash_fwd_op
    else:
        op = _flash_fwd_op
    o4, lse4 = op(q, k, v, is_causal)
    return o4.reshape(Q.shape), lse4.reshape(Q.shape[:-1])


def _forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool) -> torch.Tensor:
    check_is_causal(is_causal)
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
        O, L = _fwd_via_op(Q, K, V, is_causal)
        ctx.plan = None
    else:
        # Eager: the plan of this call signature launches the kernels (inputs checked once per signature).
        ctx.plan = kernels.attention_plan(Q, K, V, is_causal, check=_check_triton_inputs)
        O, L = ctx.plan.forward(Q, K, V)
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal = is_causal
    return O


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and Triton two-pass backward."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        return _forward(ctx, Q, K, V, is_causal)

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        if ctx.plan is not None:
            return (*ctx.plan.backward(Q, K, V, O, dO, L), None)
        q, k, v, o, do = (as_4d(t) for t in (Q, K, V, O, dO))
        if torch.compiler.is_compiling():
            op = _flash_bwd_traced if _traced(q, k) else _flash_bwd_op
        else:  # the forward ran under a dispatch mode
            op = kernels.flash_backward
        dq, dk, dv = op(q, k, v, o, do, L.reshape(q.shape[:-1]), ctx.is_causal)
        return dq.reshape(Q.shape), dk.reshape(K.shape), dv.reshape(V.shape), None


class FlashAttentionTritonCompiledBackward(FlashAttentionTriton):
    """FlashAttention-2: the same Triton forward, torch.compile'd PyTorch backward from L and D (D10)."""

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        return (*compiled_flash_backward(Q, K, V, O, dO, L, ctx.is_causal), None)


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False):
    """Registry entry "flash_triton": ``(q, k, v, is_causal)`` with (..., seq, d) inputs."""
    return FlashAttentionTriton.apply(q, k, v, is_causal)
