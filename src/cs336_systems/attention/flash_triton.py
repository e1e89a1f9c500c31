"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions, and the one routing decision.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two launches,
no atomics; on Hopper, where the tuner chose it, the one-pass backward, whose dQ is added up in no fixed
order: ``torch.use_deterministic_algorithms(True)`` gets the split one).
``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch backward of
:mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) with any strides
(passed to the kernels as they are: no copies), with n_queries != n_keys.

:func:`route` picks one of three routes per call; the table with the figure behind each is in
docs/architecture.md:

- ``"plan"``: an eager call. The call signature's :class:`~cs336_systems.kernels.flash.AttentionPlan`
  launches the kernels (a custom op's dispatch would cost more host time than the launch itself).
- ``"op"``: an opaque custom op whose body runs the eager plan: under a Python dispatch mode (selective
  checkpointing keeps its output by op, FlopCounterMode counts it), and in compiled graphs for large,
  GPU-bound cases, whose kernels may then use tensor descriptors and Gluon.
- ``"traced"``: a ``triton_op`` that compiled graphs trace into, for small, host-bound cases: inductor
  launches block-pointer kernels from its own code. If the graph is being compiled for CUDA graphs
  (``mode="reduce-overhead"``: known only while it is lowered, which is when the body runs), the body
  emits the op instead with "graphed" plans: a replay pays no launcher host time, so the faster
  descriptor and Gluon kernels cost nothing extra there.
"""

from __future__ import annotations

import torch

from cs336_systems.attention.flash_pytorch import (
    check_attention_inputs,
    check_is_causal,
    compiled_flash_backward,
)
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash import as_4d
from cs336_systems.kernels.flash.select import Route

INTERPRET = flash.INTERPRET
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = flash.MAX_HEAD_DIM


def route(q: torch.Tensor, k: torch.Tensor) -> Route:
    """The route of a call with 4-D ``q``, ``k`` (see the module docstring): :func:`flash.route_for`, the
    rule docs/architecture.md tables (under Triton's CPU interpreter ``wrap_triton`` returns the plain
    kernel, which cannot be traced: CPU cases never take the traced route)."""
    batch, heads, n_q, d = q.shape
    compiling = torch.compiler.is_compiling()
    return flash.route_for(
        compiling=compiling,
        # (not read while compiling: dynamo cannot trace torch's dispatch-mode stack and breaks the graph)
        dispatch_mode=not compiling and flash.compat.dispatch_mode_active(),
        cuda=q.is_cuda,
        work=batch * heads * n_q * k.shape[2] * d,
        traced_max_work=flash.flash_settings().traced_max_work,
        cuda_graphs=False,  # known only while lowering (the traced bodies ask)
    )[0]


@torch.library.custom_op("cs336_systems::flash_attention_fwd", mutates_args=())
def _flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, graphed: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash.flash_forward(q, k, v, is_causal, "graphed" if graphed else "eager")


@_flash_fwd_op.register_fake
def _(q, k, v, is_causal, graphed=False):
    return flash.new_output(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


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
    return flash.flash_backward(q, k, v, o, do, lse, is_causal, "graphed" if graphed else "eager")


@_flash_bwd_op.register_fake
def _(q, k, v, o, do, lse, is_causal, graphed=False):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


# Under CUDA graphs the traced bodies emit the op with graphed plans: in the compiled xl model (H100) the
# traced kernels took 4.33 ms per step, cuDNN's 4.23 and the graphed ones 3.97 (docs/perf-notes.md,
# H100, 2026-11-24).
@torch.library.triton_op("cs336_systems::flash_attention_fwd_traced", mutates_args=())
def _flash_fwd_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    if flash.compat.lowering_for_cuda_graphs():
        flash.tune_ahead(q, k, v, is_causal, "graphed")
        return _flash_fwd_op(q, k, v, is_causal, True)
    return flash.flash_forward_traced(q, k, v, is_causal)


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
    if flash.compat.lowering_for_cuda_graphs():
        flash.tune_ahead(q, k, v, is_causal, "graphed")
        return _flash_bwd_op(q, k, v, o, do, lse, is_causal, True)
    return flash.flash_backward_traced(q, k, v, o, do, lse, is_causal)


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


def _forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool) -> torch.Tensor:
    check_is_causal(is_causal)
    ctx.plan = None
    if torch.compiler.is_compiling() or flash.compat.dispatch_mode_active():
        _check_triton_inputs(Q, K, V, is_causal)
        q, k, v = as_4d(Q), as_4d(K), as_4d(V)
        op = _flash_fwd_traced if route(q, k) == "traced" else _flash_fwd_op
        o4, lse4 = op(q, k, v, is_causal)
        O, L = o4.reshape(Q.shape), lse4.reshape(Q.shape[:-1])
    else:  # the "plan" route (inputs checked once per call signature)
        ctx.plan = flash.attention_plan(Q, K, V, is_causal, check=_check_triton_inputs)
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
            op = _flash_bwd_traced if route(q, k) == "traced" else _flash_bwd_op
        else:  # the forward ran under a dispatch mode: its plan, launched directly
            op = flash.flash_backward
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
