"""D9a / D10: FlashAttention-2 in plain PyTorch.

``FlashAttentionPytorch.apply(Q, K, V, is_causal=False)`` runs the tiled forward of Algorithm 1 (online
softmax over key tiles, one query tile at a time) and saves L, Q, K, V, O. Its backward recomputes P from
L and D = rowsum(dO ∘ O) (equations 13–19) in :func:`flash_backward`, a plain PyTorch function that the
Triton class reuses, torch.compile'd, as its alternative backward.

Shapes: Q (..., n_queries, d), K and V (..., n_keys, d); any leading dims (batch, or batch and heads).
Causal masking follows the handout: masked scores get -1e6 added (key j is masked for query i when j > i).
"""

from __future__ import annotations

import math

import torch

from cs336_systems.attention.reference import MASK_BIAS, causal_mask

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def check_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Shared validation: clear errors naming the mismatch instead of a shape error deep inside a matmul."""
    for name, t in (("Q", q), ("K", k), ("V", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.ndim < 2:
            raise ValueError(f"{name} must have shape (..., seq, d); got {tuple(t.shape)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{name} has unsupported dtype {t.dtype}; use one of {SUPPORTED_DTYPES}")
    if not (q.ndim == k.ndim == v.ndim):
        raise ValueError(f"Q, K, V must have the same rank; got {q.ndim}, {k.ndim}, {v.ndim}")
    if not (q.shape[:-2] == k.shape[:-2] == v.shape[:-2]):
        raise ValueError(
            f"Q, K, V batch/head dims differ: {tuple(q.shape[:-2])}, {tuple(k.shape[:-2])}, {tuple(v.shape[:-2])}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"K and V must have the same number of keys; got {k.shape[-2]} and {v.shape[-2]}")
    if not (q.shape[-1] == k.shape[-1] == v.shape[-1]):
        raise ValueError(f"Q, K, V head dims differ: {q.shape[-1]}, {k.shape[-1]}, {v.shape[-1]}")
    if q.shape[-2] == 0 or k.shape[-2] == 0:
        raise ValueError("attention needs at least one query and one key")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"Q, K, V dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"Q, K, V are on different devices: {q.device}, {k.device}, {v.device}")


def check_is_causal(is_causal: object) -> bool:
    """``is_causal`` must be a real bool: a truthy string such as "no" would silently mean causal."""
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__} {is_causal!r}")
    return is_causal


def _causal_bias(q_start: int, n_q: int, k_start: int, n_k: int, device: torch.device) -> torch.Tensor:
    q_idx = torch.arange(q_start, q_start + n_q, device=device)[:, None]
    k_idx = torch.arange(k_start, k_start + n_k, device=device)[None, :]
    return torch.where(k_idx > q_idx, MASK_BIAS, 0.0)


def flash_forward_tiled(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool = False,
    q_tile: int = 64,
    k_tile: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Algorithm 1 in PyTorch. Returns O (input dtype) and L (float32), shapes (..., Nq, d) and (..., Nq).

    On-chip buffers (O_i, l, m) are float32 as in the kernel; tiles need not divide the sequence lengths.
    """
    if q_tile < 16 or k_tile < 16:
        raise ValueError(f"tiles must be at least 16x16, got {q_tile}x{k_tile}")
    n_q, n_k, d = q.shape[-2], k.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(d)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    for q0 in range(0, n_q, q_tile):
        q_i = q[..., q0 : q0 + q_tile, :].float()
        bq = q_i.shape[-2]
        o_i = torch.zeros_like(q_i)
        l_i = torch.zeros(q_i.shape[:-1], device=q.device, dtype=torch.float32)
        m_i = torch.full_like(l_i, -math.inf)
        # Key tiles entirely above the diagonal only add exp(-1e6) = 0: stop before them.
        k_end = min(n_k, q0 + bq) if is_causal else n_k
        for k0 in range(0, k_end, k_tile):
            k_j = k[..., k0 : k0 + k_tile, :].float()
            v_j = v[..., k0 : k0 + k_tile, :].float()
            s = q_i @ k_j.transpose(-2, -1) * scale
            if is_causal:
                s = s + _causal_bias(q0, bq, k0, k_j.shape[-2], q.device)
            m_new = torch.maximum(m_i, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m_i - m_new)
            l_i = alpha * l_i + p.sum(dim=-1)
            o_i = alpha[..., None] * o_i + p @ v_j
            m_i = m_new
        o[..., q0 : q0 + bq, :] = (o_i / l_i[..., None]).to(q.dtype)
        lse[..., q0 : q0 + bq] = m_i + torch.log(l_i)
    return o, lse


def flash_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    do: torch.Tensor,
    lse: torch.Tensor,
    is_causal: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Equations 13–19: gradients from L and D = rowsum(dO ∘ O), without a softmax. Math in float32,
    gradients returned in the input dtype. Materializes (..., Nq, Nk) scores (fine compiled for moderate
    sizes; the Triton backward is the tiled one)."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    qf, kf, vf, of, dof = (t.float() for t in (q, k, v, o, do))
    delta = (dof * of).sum(dim=-1)
    s = qf @ kf.transpose(-2, -1) * scale
    if is_causal:
        keep = causal_mask(q.shape[-2], k.shape[-2], q.device)
        s = s + torch.where(keep, 0.0, MASK_BIAS)
    p = torch.exp(s - lse[..., None])
    dv = p.transpose(-2, -1) @ dof
    dp = dof @ vf.transpose(-2, -1)
    ds = p * (dp - delta[..., None])
    dq = ds @ kf * scale
    dk = ds.transpose(-2, -1) @ qf * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_compiled_backward = None


def compiled_flash_backward(*args, **kwargs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`flash_backward` through torch.compile (D10), compiled on first use rather than at import."""
    global _compiled_backward
    if _compiled_backward is None:
        _compiled_backward = torch.compile(flash_backward)
    return _compiled_backward(*args, **kwargs)


class FlashAttentionPytorch(torch.autograd.Function):
    """FlashAttention-2 in plain PyTorch. Saves L, Q, K, V, O; L has shape Q.shape[:-1] = (batch, Nq)."""

    # "compiled": torch.compile'd flash_backward (D10); "eager": the same function uncompiled; "auto":
    # compiled on CUDA, eager on CPU (inductor's CPU path needs a C++ toolchain and compiles per shape).
    backward_mode: str = "auto"

    @staticmethod
    def forward(
        ctx, Q: torch.Tensor, K: torch.Tensor, V: torch.Tensor, is_causal: bool = False
    ) -> torch.Tensor:
        check_attention_inputs(Q, K, V)
        check_is_causal(is_causal)
        O, L = flash_forward_tiled(Q, K, V, is_causal)
        ctx.save_for_backward(L, Q, K, V, O)
        ctx.is_causal = is_causal
        return O

    @staticmethod
    def backward(ctx, dO: torch.Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        mode = FlashAttentionPytorch.backward_mode
        if mode == "compiled" or (mode == "auto" and Q.is_cuda):
            dQ, dK, dV = compiled_flash_backward(Q, K, V, O, dO, L, ctx.is_causal)
        elif mode in ("eager", "auto"):
            dQ, dK, dV = flash_backward(Q, K, V, O, dO, L, ctx.is_causal)
        else:
            raise ValueError(f"backward_mode must be 'auto', 'compiled' or 'eager', got {mode!r}")
        return dQ, dK, dV, None


def flash_attention_pytorch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False):
    """Registry entry "flash_pytorch": ``(q, k, v, is_causal)`` with (..., seq, d) inputs."""
    return FlashAttentionPytorch.apply(q, k, v, is_causal)
