"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two launches,
no atomics). ``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch
backward of :mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) with any strides
(passed to the kernels as they are: no copies), with n_queries != n_keys.

Under torch.compile the kernels sit behind two torch custom ops, so the graph holds opaque calls with
known output shapes instead of Triton launch code and the tuning loop. In eager mode the launchers are
called directly: a custom op's Python dispatch costs more than the launch itself, and the model calls
attention 2 x layers times per step.
"""

from __future__ import annotations

import torch

from cs336_systems.attention.flash_pytorch import (
    check_attention_inputs,
    check_is_causal,
    compiled_flash_backward,
)
from cs336_systems.kernels import flash_attention as kernels

INTERPRET = kernels.INTERPRET
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = kernels.MAX_HEAD_DIM


@torch.library.custom_op("cs336_systems::flash_attention_fwd", mutates_args=())
def _flash_fwd_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    return kernels.flash_forward(q, k, v, is_causal)


@_flash_fwd_op.register_fake
def _(q, k, v, is_causal):
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return kernels.flash_backward(q, k, v, o, do, lse, is_causal)


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


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): a view for 2-, 3- and 4-D input (strides kept as they are);
    more leading dims are folded into the batch axis."""
    if t.ndim == 4:
        return t
    if t.ndim == 3:
        return t.unsqueeze(1)
    if t.ndim == 2:
        return t[None, None]
    return t.reshape(-1, *t.shape[-3:])


def _fwd(q, k, v, is_causal):
    compiling = torch.compiler.is_compiling()
    return (_flash_fwd_op if compiling else kernels.flash_forward)(q, k, v, is_causal)


def _bwd(q, k, v, o, do, lse, is_causal):
    compiling = torch.compiler.is_compiling()
    return (_flash_bwd_op if compiling else kernels.flash_backward)(q, k, v, o, do, lse, is_causal)


def _forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool) -> torch.Tensor:
    _check_triton_inputs(Q, K, V, is_causal)
    o4, lse4 = _fwd(_as_4d(Q), _as_4d(K), _as_4d(V), is_causal)
    O = o4.reshape(Q.shape)
    L = lse4.reshape(Q.shape[:-1])
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
        q, k, v, o, do = (_as_4d(t) for t in (Q, K, V, O, dO))
        dq, dk, dv = _bwd(q, k, v, o, do, L.reshape(q.shape[:-1]), ctx.is_causal)
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
