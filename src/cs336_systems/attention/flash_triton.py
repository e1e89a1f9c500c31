"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two passes, no
atomics). ``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch
backward of :mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) (leading dims are
flattened into the kernels' batch axis), non-contiguous (copied), with n_queries != n_keys.

The kernels sit behind two torch custom ops, so ``torch.compile(FlashAttentionTriton.apply)`` sees opaque
calls with known output shapes instead of tracing into Triton launch code and the tuning loop.
"""

from __future__ import annotations

import torch

from cs336_systems.attention.flash_pytorch import check_attention_inputs, compiled_flash_backward
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
    return torch.empty_like(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


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


def _check_triton_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    check_attention_inputs(q, k, v)
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


def _as_3d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> contiguous (batch, seq, d); a no-op view for contiguous 3-D input."""
    return t.reshape(-1, t.shape[-2], t.shape[-1]).contiguous()


def _forward(ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool) -> torch.Tensor:
    _check_triton_inputs(Q, K, V)
    is_causal = bool(is_causal)
    o3, lse3 = _flash_fwd_op(_as_3d(Q), _as_3d(K), _as_3d(V), is_causal)
    O = o3.view(Q.shape)
    L = lse3.view(Q.shape[:-1])
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal = is_causal
    return O


def _backward(ctx, dO: torch.Tensor, backward_fn):
    L, Q, K, V, O = ctx.saved_tensors
    q, k, v, o, do = (_as_3d(t) for t in (Q, K, V, O, dO))
    lse = L.reshape(q.shape[0], q.shape[1]).contiguous()
    dq, dk, dv = backward_fn(q, k, v, o, do, lse, ctx.is_causal)
    return dq.view(Q.shape), dk.view(K.shape), dv.view(V.shape), None


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2: Triton forward and Triton two-pass backward."""

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        return _forward(ctx, Q, K, V, is_causal)

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        return _backward(ctx, dO, _flash_bwd_op)


class FlashAttentionTritonCompiledBackward(FlashAttentionTriton):
    """FlashAttention-2: the same Triton forward, torch.compile'd PyTorch backward from L and D (D10)."""

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        return _backward(ctx, dO, compiled_flash_backward)


def flash_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False):
    """Registry entry "flash_triton": ``(q, k, v, is_causal)`` with (..., seq, d) inputs."""
    return FlashAttentionTriton.apply(q, k, v, is_causal)
