"""D9b/c, D10, D12: FlashAttention-2 with Triton kernels as autograd.Functions.

``FlashAttentionTriton.apply(Q, K, V, is_causal=False)``: Triton forward, Triton backward (two launches,
no atomics). ``FlashAttentionTritonCompiledBackward`` has the same forward and the torch.compile'd PyTorch
backward of :mod:`flash_pytorch` (D10). Both save L, Q, K, V, O; L has shape Q.shape[:-1], i.e.
(batch, n_queries) for (batch, seq, d) inputs. Inputs may also be (batch, heads, seq, d) with any strides
(passed to the kernels as they are: no copies), with n_queries != n_keys.

Under torch.compile, two paths by size. Small cases (the model at short context: host-bound, ~10 µs of
GPU work per launch) go through ``torch.library.triton_op``: inductor traces into the op, bakes the
tuned block-pointer config and launches the kernels from its own generated code, so a compiled step runs
none of our Python per call (and CUDA graphs can capture it). Large cases go through two opaque custom
ops whose launchers tune at first run and may use tensor descriptors (TMA), which pay off there. In eager
mode the launchers are called directly: a custom op's Python dispatch costs more than the launch itself,
and the model calls attention 2 x layers times per step; the forward goes through its op again under a
Python dispatch mode (selective checkpointing keeps its output by op).
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


# Up to this many batch·heads·n_q·n_k·d (the xl model at ctx 512 is 1.7e9, (4, 16, 1024, 1024, 128) 8.6e9),
# compiled graphs launch the kernels themselves (traced path). Larger cases are GPU-bound and keep the
# custom ops, whose tuner may pick TMA configs.
TRACED_MAX_WORK = 1 << 33


@torch.library.triton_op("cs336_systems::flash_attention_fwd_traced", mutates_args=())
def _flash_fwd_traced(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
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
    if torch.compiler.is_compiling():
        return (_flash_fwd_traced if _traced(q, k) else _flash_fwd_op)(q, k, v, is_causal)
    # Under a Python dispatch mode (selective activation checkpointing, FlopCounterMode) the mode sees one
    # attention op, which it can keep or count, instead of the launcher's inner ops.
    via_op = _get_current_dispatch_mode() is not None
    return (_flash_fwd_op if via_op else kernels.flash_forward)(q, k, v, is_causal)


def _bwd(q, k, v, o, do, lse, is_causal):
    if torch.compiler.is_compiling():
        op = _flash_bwd_traced if _traced(q, k) else _flash_bwd_op
        return op(q, k, v, o, do, lse, is_causal)
    return kernels.flash_backward(q, k, v, o, do, lse, is_causal)


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
