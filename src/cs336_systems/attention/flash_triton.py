"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions, and the one routing decision.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two launches,
no atomics; on Hopper, where the tuner chose it, the one-pass backward, whose dQ is added up in no fixed
order: ``torch.use_deterministic_algorithms(True)`` gets the split one).
``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch backward of
:mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) with any strides
(passed to the kernels as they are: no copies), with n_queries != n_keys.

Each call takes one of two routes (:func:`flash.route_for`, the rule docs/architecture.md tables with the
figure behind each):

- ``"plan"``: an eager call. The call signature's :class:`~cs336_systems.kernels.flash.AttentionPlan`
  launches the kernels (a custom op's dispatch would cost more host time than the launch itself).
- ``"op"``: an opaque custom op whose body runs the same plan: in compiled graphs, and under a Python
  dispatch mode (selective checkpointing keeps its output by op, FlopCounterMode counts it). Under CUDA
  graphs (``mode="reduce-overhead"``) the graph records the plan's launches after the warm-up run built it.
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

INTERPRET = flash.INTERPRET
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = flash.MAX_HEAD_DIM


@torch.library.custom_op("cs336_systems::flash_attention_fwd", mutates_args=())
def _flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return flash.flash_forward(q, k, v, is_causal)


@_flash_fwd_op.register_fake
def _(q, k, v, is_causal):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return flash.flash_backward(q, k, v, o, do, lse, is_causal)


@_flash_bwd_op.register_fake
def _(q, k, v, o, do, lse, is_causal):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


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


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and Triton two-pass backward."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        check_is_causal(is_causal)
        ctx.plan = None
        compiling = torch.compiler.is_compiling()
        # (not read while compiling: dynamo cannot trace torch's dispatch-mode stack and breaks the graph)
        dispatch_mode = not compiling and flash.compat.dispatch_mode_active()
        if flash.route_for(compiling=compiling, dispatch_mode=dispatch_mode) == "op":
            _check_triton_inputs(Q, K, V, is_causal)
            o4, lse4 = _flash_fwd_op(as_4d(Q), as_4d(K), as_4d(V), is_causal)
            O, L = o4.reshape(Q.shape), lse4.reshape(Q.shape[:-1])
        else:  # the "plan" route (inputs checked once per call signature)
            ctx.plan = flash.attention_plan(Q, K, V, is_causal, check=_check_triton_inputs)
            O, L = ctx.plan.forward(Q, K, V)
        ctx.save_for_backward(L, Q, K, V, O)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        if ctx.plan is not None:
            return (*ctx.plan.backward(Q, K, V, O, dO, L), None)
        q, k, v, o, do = (as_4d(t) for t in (Q, K, V, O, dO))
        # Compiled: the op; after a forward under a dispatch mode, its plan, launched directly.
        op = _flash_bwd_op if torch.compiler.is_compiling() else flash.flash_backward
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
