"""FlashAttention-2 in Triton, forward and backward (a plain student-style kernel: 64 x 64 tiles, no
bounds masks, D = rowsum(dO * O) in PyTorch). The honest kernel the leaderboard's adversaries build on."""

import math

import torch
import triton
import triton.language as tl

TILE = 64


@triton.jit
def lb_fwd_kernel(Q, K, V, O, L, N, scale, D: tl.constexpr, T: tl.constexpr, CAUSAL: tl.constexpr):
    qi, b = tl.program_id(0), tl.program_id(1)
    rows = qi * T + tl.arange(0, T)
    cols = tl.arange(0, T)
    dims = tl.arange(0, D)
    base = b * N * D
    q = tl.load(Q + base + rows[:, None] * D + dims[None, :])
    m = tl.full([T], -float("inf"), tl.float32)
    l = tl.zeros([T], tl.float32)
    acc = tl.zeros([T, D], tl.float32)
    hi = (qi + 1) * T if CAUSAL else N
    for start in range(0, hi, T):
        k = tl.load(K + base + (start + cols)[:, None] * D + dims[None, :])
        v = tl.load(V + base + (start + cols)[:, None] * D + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        if CAUSAL:
            s = tl.where(rows[:, None] >= (start + cols)[None, :], s, -1e6)
        m_new = tl.maximum(m, tl.max(s, 1))
        p = tl.exp(s - m_new[:, None])
        alpha = tl.exp(m - m_new)
        l = l * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new
    tl.store(O + base + rows[:, None] * D + dims[None, :], (acc / l[:, None]).to(O.dtype.element_ty))
    tl.store(L + b * N + rows, m + tl.log(l))


@triton.jit
def lb_bwd_dkdv_kernel(
    Q, K, V, DO, L, DL, DK, DV, N, scale, D: tl.constexpr, T: tl.constexpr, CAUSAL: tl.constexpr
):
    ki, b = tl.program_id(0), tl.program_id(1)
    cols = ki * T + tl.arange(0, T)
    rows0 = tl.arange(0, T)
    dims = tl.arange(0, D)
    base = b * N * D
    k = tl.load(K + base + cols[:, None] * D + dims[None, :])
    v = tl.load(V + base + cols[:, None] * D + dims[None, :])
    dk = tl.zeros([T, D], tl.float32)
    dv = tl.zeros([T, D], tl.float32)
    lo = ki * T if CAUSAL else 0
    for start in range(lo, N, T):
        rows = start + rows0
        q = tl.load(Q + base + rows[:, None] * D + dims[None, :])
        do = tl.load(DO + base + rows[:, None] * D + dims[None, :])
        lse = tl.load(L + b * N + rows)
        dl = tl.load(DL + b * N + rows)
        s = tl.dot(q, tl.trans(k)) * scale
        if CAUSAL:
            s = tl.where(rows[:, None] >= cols[None, :], s, -1e6)
        p = tl.exp(s - lse[:, None])
        dv += tl.dot(tl.trans(p.to(do.dtype)), do)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - dl[:, None]) * scale
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    tl.store(DK + base + cols[:, None] * D + dims[None, :], dk.to(DK.dtype.element_ty))
    tl.store(DV + base + cols[:, None] * D + dims[None, :], dv.to(DV.dtype.element_ty))


@triton.jit
def lb_bwd_dq_kernel(
    Q, K, V, DO, L, DL, DQ, N, scale, D: tl.constexpr, T: tl.constexpr, CAUSAL: tl.constexpr
):
    qi, b = tl.program_id(0), tl.program_id(1)
    rows = qi * T + tl.arange(0, T)
    cols0 = tl.arange(0, T)
    dims = tl.arange(0, D)
    base = b * N * D
    q = tl.load(Q + base + rows[:, None] * D + dims[None, :])
    do = tl.load(DO + base + rows[:, None] * D + dims[None, :])
    lse = tl.load(L + b * N + rows)
    dl = tl.load(DL + b * N + rows)
    dq = tl.zeros([T, D], tl.float32)
    hi = (qi + 1) * T if CAUSAL else N
    for start in range(0, hi, T):
        cols = start + cols0
        k = tl.load(K + base + cols[:, None] * D + dims[None, :])
        v = tl.load(V + base + cols[:, None] * D + dims[None, :])
        s = tl.dot(q, tl.trans(k)) * scale
        if CAUSAL:
            s = tl.where(rows[:, None] >= cols[None, :], s, -1e6)
        p = tl.exp(s - lse[:, None])
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - dl[:, None]) * scale
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + base + rows[:, None] * D + dims[None, :], dq.to(DQ.dtype.element_ty))


def forward(q, k, v, is_causal):
    b, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, n), device=q.device, dtype=torch.float32)
    lb_fwd_kernel[(n // TILE, b)](q, k, v, o, lse, n, 1 / math.sqrt(d), D=d, T=TILE, CAUSAL=is_causal)
    return o, lse


def backward(q, k, v, o, lse, d_o, is_causal):
    b, n, d = q.shape
    d_o = d_o.contiguous()
    dl = (d_o.float() * o.float()).sum(-1)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    args = (n, 1 / math.sqrt(d))
    lb_bwd_dkdv_kernel[(n // TILE, b)](q, k, v, d_o, lse, dl, dk, dv, *args, D=d, T=TILE, CAUSAL=is_causal)
    lb_bwd_dq_kernel[(n // TILE, b)](q, k, v, d_o, lse, dl, dq, *args, D=d, T=TILE, CAUSAL=is_causal)
    return dq, dk, dv


class FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        return (*backward(q, k, v, o, lse, d_o, ctx.is_causal), None)
