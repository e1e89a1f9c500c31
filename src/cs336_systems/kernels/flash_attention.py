"""Triton kernels of FlashAttention-2 (D9b/c, D12) and their launchers.

Inputs are (batch, heads, seq, d) tensors of any strides (the model's V is a permuted view of its fused
QKV projection): every kernel takes four strides per tensor and a grid (tiles, batch * heads), so no
input is copied. O is written in (batch, seq, heads, d) memory order (returned as a (batch, heads, seq,
d) view), which makes the model's ``out.transpose(1, 2).reshape(...)`` free.

Forward (Algorithm 1): one program per query tile, one pass over key tiles with an online softmax in
float32. Backward (Algorithm 2 split in two, no atomics, two launches): a dQ kernel (loops over key tiles)
that also computes D = rowsum(dO ∘ O) for its rows and stores it, then a dK/dV kernel (loops over query
tiles) that reads D; each recomputes P from L.

Speed tricks (handout 1.3.3): scores are kept in log2 units (exp2, with 1/sqrt(d)·log2(e) folded into one
multiply); with causal masking, key tiles past the diagonal are never visited, and the tiles that straddle
the diagonal run a masked copy of the loop while all others run without any index comparison; the causal
forward and dQ grids start with the heaviest query tiles; on Hopper, tiles move through tensor
descriptors (the TMA copy engine; block pointers where strides do not allow it, or where the host-side
cost of building descriptors outweighs the gain, which the tuner measures). Tile sizes, warps, stages and
descriptors-or-not are tuned per (kernel, batch x heads bucket, seq buckets, d, causal, dtype) among a
short candidate list, timed once per key and cached (in memory, optionally in a JSON file); the lookup on
later calls is one dict access, since the model calls these launchers 2 x layers times per step.

Boundaries: sequence lengths need not be multiples of the tiles. Out-of-range rows load as zeros; in the
forward and dQ kernels the last key tile is masked explicitly (padding keys must add nothing to the
softmax); elsewhere zero padding alone makes padded rows contribute nothing (dO and D are zero there).
Head dims that are not powers of two are padded to the next one (zeros do not change dot products).
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import triton
import triton.language as tl
import triton.testing
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError
from triton.tools.tensor_descriptor import TensorDescriptor

# Triton reads TRITON_INTERPRET when a kernel is decorated, so what counts is its value at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# "0" turns tuning off: each kernel then runs the first (heuristic) candidate for its case.
AUTOTUNE = os.environ.get("CS336_FLASH_AUTOTUNE", "1") != "0"
# Optional JSON file that keeps tuning results across processes (read at first use, rewritten on change).
TUNE_CACHE_PATH = os.environ.get("CS336_FLASH_TUNE_CACHE")
# "wide": tune over a broad grid of tiles x warps x stages (slow; to find what the short lists should hold).
CANDIDATE_SET = os.environ.get("CS336_FLASH_CANDIDATES", "default")
# What the tuner minimises: "launch" (default: back-to-back launches, i.e. the larger of device and host
# time per launch, what a host-bound call pays) or "device" (do_bench kernel time, L2 flushed between
# launches: what a GPU-bound step pays; it picked host-heavier TMA configs for short shapes on H100).
TUNE_METRIC = os.environ.get("CS336_FLASH_TUNE_METRIC", "launch")
# "0": every launch goes through Triton's JIT dispatch (argument binding, specialization, cache key)
# instead of the compiled kernel remembered for the call's signature.
DIRECT_LAUNCH = os.environ.get("CS336_FLASH_DIRECT_LAUNCH", "1") != "0"

# Globals read inside kernels must be constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MASK_BIAS = tl.constexpr(-1e6)  # the handout's additive mask, in natural-log units
MAX_HEAD_DIM = 128
# What a candidate that cannot be built for this GPU raises (tuning skips any failing candidate, keeping
# the reason in tuning_report()).
BUILD_ERRORS = (OutOfResources, CompilationError, PTXASError)
# The triton 3.6 interpreter multiplies bfloat16 dot operands wrongly (numpy has no bfloat16): under it,
# operands are widened to float32 first, which is exact and keeps the algorithm's roundings (P, dS casts).
_WIDEN_DOTS = tl.constexpr(INTERPRET)


# Kernels keep the Triton tutorials' dense layout of long argument lists.
# fmt: off
# ----------------------------------------------------------------------------------------------------------
# Small helpers (inlined by Triton)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _offset(bh, H, stride_b, stride_h):
    """Element offset of head (b, h) = divmod(bh, H) of a (batch, heads, N, D) tensor, in int64."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return b * stride_b + h * stride_h


@triton.jit
def _load_rows(X, off, stride_n, stride_d, bh, H, N, start, D: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + ROWS) of head bh of a (batch, heads, N, D) tensor as a (ROWS, BLOCK_D) tile.
    Rows past N and head-dim padding read as zeros. X is a 4-D tensor descriptor (TMA: bounds checked by
    the copy engine) or a pointer (block pointer at element offset ``off``, bounds checked where asked)."""
    if USE_TMA:
        x = X.load([bh // H, bh % H, start, 0]).reshape(ROWS, BLOCK_D)
    else:
        ptr = tl.make_block_ptr(X + off, shape=(N, D), strides=(stride_n, stride_d), offsets=(start, 0),
                                block_shape=(ROWS, BLOCK_D), order=(1, 0))
        if D == BLOCK_D:
            if CHECK_ROWS:  # noqa: SIM108
                x = tl.load(ptr, boundary_check=(0,), padding_option="zero")
            else:
                x = tl.load(ptr)
        else:
            x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
    return x


@triton.jit
def _store_rows(X, x, off, stride_n, stride_d, bh, H, N, start, D: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a (ROWS, BLOCK_D) tile at rows [start, start + ROWS) of head bh, dropping out-of-range parts."""
    if USE_TMA:
        X.store([bh // H, bh % H, start, 0], x.to(X.dtype).reshape(1, 1, ROWS, BLOCK_D))
    else:
        ptr = tl.make_block_ptr(X + off, shape=(N, D), strides=(stride_n, stride_d), offsets=(start, 0),
                                block_shape=(ROWS, BLOCK_D), order=(1, 0))
        tl.store(ptr, x.to(ptr.type.element_ty), boundary_check=(0, 1))


@triton.jit
def _dot(a, b, acc=None):
    """tl.dot with a float32 result (accumulated into ``acc`` when given)."""
    if _WIDEN_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, out_dtype=tl.float32)


@triton.jit
def _loop_bounds(tile_start, N_OTHER, TILE: tl.constexpr, STEP: tl.constexpr, is_causal: tl.constexpr):
    """For a query tile [tile_start, tile_start + TILE) that loops over keys in steps of STEP: the end of
    the steps that need no mask at all, and the end of the masked ones (diagonal tiles, ragged last tile).
    Key tiles past the diagonal are never visited (they would only add exp(-1e6) = 0)."""
    full_end = (N_OTHER // STEP) * STEP
    if is_causal:
        unmasked_end = tl.minimum(tile_start, full_end)
        masked_end = tl.minimum(tile_start + TILE, N_OTHER)
    else:
        unmasked_end = full_end
        masked_end = N_OTHER
    return unmasked_end, masked_end


@triton.jit
def _query_tile(is_causal: tl.constexpr):
    """Query tile of this program: with causal masking the work grows with the query index, so the
    heaviest tiles are launched first and the tail of the grid is short."""
    if is_causal:  # noqa: SIM108
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile = tl.program_id(0)
    return tile


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk, stride_vd,
              bh, H, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
              BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASKED adds the causal bias and drops padding keys."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = _load_rows(K_ptr, off_k, stride_kk, stride_kd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = _load_rows(V_ptr, off_v, stride_vk, stride_vd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        s = _dot(q, tl.trans(k))
        if MASKED:
            offs_k = start_k + tl.arange(0, K_TILE_SIZE)
            s = s * qk_scale
            if is_causal:
                s = s + tl.where(offs_k[None, :] > offs_q[:, None], MASK_BIAS * LOG2E, 0.0)
            # Padding keys past the end must add exactly nothing to the softmax.
            s = tl.where(offs_k[None, :] < N_KEYS, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            # No mask: fold the scale into the exponent's FMA instead of a separate multiply.
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q_ptr, K_ptr, V_ptr,
    O_ptr, L_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    H, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """Algorithm 1 for one query tile of one (batch, head) (grid (T_q, batch * heads)). Q/K/V/O are
    (batch, heads, N, D) with any strides (or 4-D tensor descriptors with USE_TMA); L is contiguous
    (batch, heads, N_QUERIES) float32."""
    q_start = _query_tile(is_causal) * Q_TILE_SIZE
    bh = tl.program_id(1)
    off_q = _offset(bh, H, stride_qb, stride_qh)
    off_k = _offset(bh, H, stride_kb, stride_kh)
    off_v = _offset(bh, H, stride_vb, stride_vh)

    q = _load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    scale = tl.cast(scale, tl.float32)  # inductor passes a Python float as fp64, which would promote the math
    qk_scale = scale * LOG2E  # scores in log2 units: exp2 instead of exp
    acc = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)

    unmasked_end, masked_end = _loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                              stride_vd, bh, H, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D, K_TILE_SIZE,
                              BLOCK_D, False, is_causal, USE_TMA)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                              stride_vd, bh, H, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D,
                              K_TILE_SIZE, BLOCK_D, True, is_causal, USE_TMA)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2  # back to natural-log units: L is the contract's logsumexp
    _store_rows(O_ptr, acc, _offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES,
                q_start, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)
    tl.store(L_ptr + bh.to(tl.int64) * N_QUERIES + offs_q, lse, mask=offs_q < N_QUERIES)


# ----------------------------------------------------------------------------------------------------------
# Backward: dQ pass first (it also writes D = rowsum(dO ∘ O) for its rows), then the dK/dV pass
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk, stride_vd,
             bh, H, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
             BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = _load_rows(K_ptr, off_k, stride_kk, stride_kd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = _load_rows(V_ptr, off_v, stride_vk, stride_vd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        s = _dot(q, tl.trans(k))
        if MASKED:
            offs_k = start_k + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS  # padding keys: dS there times K = 0 would still give NaN·0
            if is_causal:
                keep = keep & (offs_k[None, :] <= offs_q[:, None])
            p = tl.exp2(tl.where(keep, s * qk_scale - lse2[:, None], float("-inf")))
        else:
            p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = _dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = _dot(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_dqb, stride_dqh, stride_dqq, stride_dqd,
    H, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """First backward pass: one program per query tile (grid (T_q, batch * heads)) computes D = rowsum(dO ∘
    O) for its rows (stored for the dK/dV pass: no separate preprocessing launch) and accumulates dQ over
    key tiles. L and D are contiguous (batch, heads, N_QUERIES) float32; O is read through a pointer."""
    q_start = _query_tile(is_causal) * Q_TILE_SIZE
    bh = tl.program_id(1)
    off_q = _offset(bh, H, stride_qb, stride_qh)
    off_do = _offset(bh, H, stride_dob, stride_doh)
    q = _load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    do = _load_rows(dO_ptr, off_do, stride_doq, stride_dod, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE,
                    BLOCK_D, True, USE_TMA)
    o = _load_rows(O_ptr, _offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES,
                   q_start, D, Q_TILE_SIZE, BLOCK_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    in_range = offs_q < N_QUERIES
    row = bh.to(tl.int64) * N_QUERIES + offs_q
    tl.store(Delta_ptr + row, delta, mask=in_range)
    lse2 = tl.load(L_ptr + row, mask=in_range, other=0.0) * LOG2E
    scale = tl.cast(scale, tl.float32)  # see flash_fwd_kernel
    qk_scale = scale * LOG2E
    off_k = _offset(bh, H, stride_kb, stride_kh)
    off_v = _offset(bh, H, stride_vb, stride_vh)
    dq = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    unmasked_end, masked_end = _loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                  stride_vd, bh, H, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D, K_TILE_SIZE, BLOCK_D, False,
                  is_causal, USE_TMA)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                  stride_vd, bh, H, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D, K_TILE_SIZE,
                  BLOCK_D, True, is_causal, USE_TMA)
    _store_rows(dQ_ptr, dq * scale, _offset(bh, H, stride_dqb, stride_dqh), stride_dqq, stride_dqd, bh, H,
                N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq, stride_qd, off_do,
               stride_doq, stride_dod, bh, H, offs_k, lo, hi, N_QUERIES, qk_scale, D: tl.constexpr,
               Q_TILE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), on transposed (keys x queries) tiles
    so that both accumulate without transposes. Rows past the end load as zeros (Q, dO, L, D): their P is
    finite and they add nothing (dO = 0, D = 0)."""
    row_base = bh.to(tl.int64) * N_QUERIES
    for start_q in range(lo, hi, Q_TILE_SIZE):
        offs_q = start_q + tl.arange(0, Q_TILE_SIZE)
        q = _load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, start_q, D, Q_TILE_SIZE,
                       BLOCK_D, True, USE_TMA)
        do = _load_rows(dO_ptr, off_do, stride_doq, stride_dod, bh, H, N_QUERIES, start_q, D, Q_TILE_SIZE,
                        BLOCK_D, True, USE_TMA)
        in_range = offs_q < N_QUERIES
        lse2 = tl.load(L_ptr + row_base + offs_q, mask=in_range, other=0.0) * LOG2E
        delta = tl.load(Delta_ptr + row_base + offs_q, mask=in_range, other=0.0)
        s_t = _dot(k, tl.trans(q))
        if MASKED:
            # exp(s - 1e6 - L) is exactly 0 in float32: -inf before exp2 gives that 0 without the bias
            # (and without overflow where a masked raw score exceeds L).
            keep = offs_q[None, :] >= offs_k[:, None]
            p_t = tl.exp2(tl.where(keep, s_t * qk_scale - lse2[None, :], float("-inf")))
        else:
            p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dv = _dot(p_t.to(do.dtype), do, dv)
        dp_t = _dot(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = _dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_dkb, stride_dkh, stride_dkk, stride_dkd,
    stride_dvb, stride_dvh, stride_dvk, stride_dvd,
    H, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """Second backward pass: one program per key tile (grid (T_k, batch * heads)) accumulates dK and dV
    over query tiles."""
    bh = tl.program_id(1)
    k_start = tl.program_id(0) * K_TILE_SIZE  # causal: low key tiles see the most queries and come first
    k = _load_rows(K_ptr, _offset(bh, H, stride_kb, stride_kh), stride_kk, stride_kd, bh, H, N_KEYS, k_start,
                   D, K_TILE_SIZE, BLOCK_D, True, USE_TMA)
    v = _load_rows(V_ptr, _offset(bh, H, stride_vb, stride_vh), stride_vk, stride_vd, bh, H, N_KEYS, k_start,
                   D, K_TILE_SIZE, BLOCK_D, True, USE_TMA)
    off_q = _offset(bh, H, stride_qb, stride_qh)
    off_do = _offset(bh, H, stride_dob, stride_doh)
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    scale = tl.cast(scale, tl.float32)  # see flash_fwd_kernel
    qk_scale = scale * LOG2E
    dk = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    if is_causal:
        # Query tiles before k_start see none of these keys, [k_start, k_start + K_TILE_SIZE) straddle the
        # diagonal, all later ones see every key of the tile.
        diag_end = tl.minimum(k_start + K_TILE_SIZE, N_QUERIES)
        dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq, stride_qd,
                            off_do, stride_doq, stride_dod, bh, H, offs_k, k_start, diag_end, N_QUERIES,
                            qk_scale, D, Q_TILE_SIZE, BLOCK_D, True, USE_TMA)
        lo = k_start + K_TILE_SIZE
    else:
        lo = 0
    dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq, stride_qd, off_do,
                        stride_doq, stride_dod, bh, H, offs_k, lo, N_QUERIES, N_QUERIES, qk_scale, D,
                        Q_TILE_SIZE, BLOCK_D, False, USE_TMA)
    _store_rows(dK_ptr, dk * scale, _offset(bh, H, stride_dkb, stride_dkh), stride_dkk, stride_dkd, bh, H,
                N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
    _store_rows(dV_ptr, dv, _offset(bh, H, stride_dvb, stride_dvh), stride_dvk, stride_dvd, bh, H, N_KEYS,
                k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
# fmt: on


# ----------------------------------------------------------------------------------------------------------
# Tuning: per-case candidate lists, timed once per key, cached in memory (and optionally on disk)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TileConfig:
    q_tile: int
    k_tile: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False  # tensor descriptors (Hopper's copy engine) instead of block pointers

    def __str__(self) -> str:
        return (
            f"q{self.q_tile}-k{self.k_tile}-w{self.num_warps}-s{self.num_stages}{'-tma' if self.tma else ''}"
        )


def _candidates(kernel: str, d: int, dtype: torch.dtype) -> list[TileConfig]:
    """Short lists per (kernel, 4-byte dtype?, d > 64?), best first (the default when tuning is off), from
    the H100 sweeps in docs/notes/attention-kernels.md. "-tma" configs fall back to block pointers with the
    same tiles where descriptors are not possible (misaligned strides). Constraints: forward and dQ need
    q_tile % k_tile == 0, dK/dV needs k_tile % q_tile == 0 (diagonal tiles line up with the loop steps)."""
    C = TileConfig
    if INTERPRET:
        # Small tiles so that the tiny CPU test shapes still span several tiles and every loop phase.
        return {"fwd": [C(32, 16)], "dkdv": [C(16, 32)], "dq": [C(32, 16)]}[kernel]
    if CANDIDATE_SET == "wide":
        return _wide_candidates(kernel)
    wide = dtype == torch.float32  # 4-byte elements: twice the shared memory and registers per tile
    big_d = d > 64
    T = True  # tensor descriptors
    return {
        ("fwd", False, False): [
            C(64, 64, 4, 4, T),
            C(128, 64, 8, 3, T),
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3),
        ],
        ("fwd", False, True): [
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 64, 4, 4, T),
            C(128, 32, 4, 3, T),
        ],
        ("fwd", True, False): [C(128, 32, 8, 3, T), C(128, 64, 8, 2, T), C(64, 32, 4, 3, T)],
        ("fwd", True, True): [C(128, 32, 8, 2, T), C(128, 32, 8, 2), C(64, 32, 4, 2)],
        ("dkdv", False, False): [
            C(64, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(32, 64, 4, 3, T),
            C(32, 128, 4, 3, T),
        ],
        ("dkdv", False, True): [
            C(32, 64, 4, 3, T),
            C(64, 128, 8, 2, T),
            C(32, 64, 4, 4, T),
            C(32, 128, 4, 3, T),  # the Triton tutorial's dK/dV tiles
            C(64, 128, 8, 3, T),  # 32k causal: backward -2.8 ms vs q32-k64-w4-s3 (issue 17)
        ],
        ("dkdv", True, False): [C(32, 128, 8, 2, T), C(32, 64, 4, 2, T), C(32, 128, 8, 3, T)],
        ("dkdv", True, True): [C(32, 32, 4, 2), C(16, 64, 4, 2, T), C(32, 32, 4, 2, T)],
        ("dq", False, False): [
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 32, 4, 3, T),
        ],
        ("dq", False, True): [
            C(64, 32, 4, 3, T),
            C(128, 64, 8, 2, T),
            C(64, 64, 4, 3, T),
            C(64, 32, 4, 4, T),
            C(128, 32, 4, 3, T),  # the Triton tutorial's dQ tiles
            C(128, 64, 8, 3, T),  # 32k causal: backward -2.1 ms vs q128-k32-w4-s3 (issue 17)
        ],
        ("dq", True, False): [C(128, 32, 8, 2, T), C(64, 32, 4, 2, T), C(128, 32, 8, 3, T)],
        ("dq", True, True): [C(64, 16, 4, 2), C(64, 16, 4, 2, T), C(32, 32, 4, 2)],
    }[kernel, wide, big_d]


def _wide_candidates(kernel: str) -> list[TileConfig]:
    """The sweep the short lists were picked from: 5 tilings x {4, 8} warps x {2, 3, 4} stages, with TMA."""
    tilings = {
        "fwd": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)],
        "dkdv": [(16, 64), (32, 64), (32, 128), (64, 64), (64, 128)],
        "dq": [(64, 32), (64, 64), (128, 32), (128, 64), (128, 128)],
    }[kernel]
    return [TileConfig(q, k, w, st, tma=True) for q, k in tilings for w in (4, 8) for st in (2, 3, 4)]


@dataclass
class _TuneState:
    cache: dict[tuple, TileConfig]
    timings: dict[tuple, dict[str, float]]
    forced: dict[str, TileConfig]
    errors: dict[str, str]
    tune_seconds: float = 0.0  # wall time spent timing candidates (compiles included), this process
    loaded: bool = False


_TUNE = _TuneState(cache={}, timings={}, forced={}, errors={})


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()  # next power of two, cheaper than a triton call


def _tune_key(kernel: str, bh: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype) -> tuple:
    """Sequence lengths are bucketed to powers of two (ragged lengths share their bucket's choice) and so
    is batch x heads up to 64: with few heads the grid is short, and smaller tiles fill more SMs."""
    return (kernel, min(_bucket(bh), 64), _bucket(n_q), _bucket(n_k), d, causal, dtype)


def _key_str(key: tuple) -> str:
    kernel, bh, n_q, n_k, d, causal, dtype = key
    causal_s = "causal" if causal else "full"
    return f"{kernel}|bh{bh}|q{n_q}|k{n_k}|d{d}|{causal_s}|{str(dtype).removeprefix('torch.')}"


def _load_disk_cache() -> None:
    _TUNE.loaded = True
    if not TUNE_CACHE_PATH or not os.path.exists(TUNE_CACHE_PATH):
        return
    dtypes = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16)}
    with open(TUNE_CACHE_PATH) as f:
        for key, cfg in json.load(f).items():
            kernel, bh, n_q, n_k, d, causal, dtype = key.split("|")
            parsed = (kernel, int(bh[2:]), int(n_q[1:]), int(n_k[1:]), int(d[1:]), causal == "causal")
            _TUNE.cache.setdefault((*parsed, dtypes[dtype]), TileConfig(**cfg))


def _save_disk_cache() -> None:
    if TUNE_CACHE_PATH:
        with open(TUNE_CACHE_PATH, "w") as f:
            json.dump({_key_str(k): asdict(v) for k, v in _TUNE.cache.items()}, f, indent=1, sort_keys=True)


def tuning_report() -> dict[str, Any]:
    """Chosen config and candidate timings (ms) per key, why candidates failed to build, if any, and the
    seconds spent tuning in this process."""
    report = {
        _key_str(k): {"chosen": str(v), "timings_ms": _TUNE.timings.get(k, {})}
        for k, v in _TUNE.cache.items()
    }
    return {"keys": report, "build_errors": dict(_TUNE.errors), "tune_seconds": _TUNE.tune_seconds}


def chosen_configs(
    batch_heads: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype
) -> dict[str, str]:
    """The config each kernel uses for this case (tuned, forced or default), for bench rows."""
    out = {}
    for kernel in ("fwd", "dq", "dkdv"):
        key = _tune_key(kernel, batch_heads, n_q, n_k, d, causal, dtype)
        cfg = _TUNE.forced.get(kernel) or _TUNE.cache.get(key) or candidate_configs(kernel, d, dtype)[0]
        out[kernel] = str(cfg)
    return out


def clear_tuning_cache() -> None:
    _TUNE.cache.clear()
    _TUNE.timings.clear()
    _TUNE.tune_seconds = 0.0


def force_config(kernel: str, config: TileConfig | None) -> None:
    """Pin ``kernel`` ("fwd", "dkdv", "dq") to ``config`` (None unpins): tests check every candidate."""
    if config is None:
        _TUNE.forced.pop(kernel, None)
    else:
        _TUNE.forced[kernel] = config


@functools.cache
def candidate_configs(kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates of ``kernel`` for head dim ``d``: the short list, plus the block-pointer twin of its
    first entry (for short sequences, building tensor descriptors on the host costs more than TMA saves)."""
    listed = _candidates(kernel, triton.next_power_of_2(d), dtype)
    twin = replace(listed[0], tma=False)
    return tuple(listed) if twin in listed or INTERPRET else (*listed, twin)


def _launch_time_ms(launch: Callable[[], None], budget_ms: float = 5.0) -> float:
    """Milliseconds per launch of back-to-back launches (best of 3 rounds): the larger of device time and
    host time per launch. do_bench would flush L2 between launches, which also gives the host time to
    catch up and hides its cost; but short cases are host-bound (the model calls these 2 x layers times
    per step), and there building tensor descriptors on the host costs more than TMA saves."""
    launch()  # compiles
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    reps = max(1, min(20, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    best = math.inf
    for _ in range(3):
        start.record()
        for _ in range(reps):
            launch()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / reps)
    return best


def _device_time_ms(launch: Callable[[], None]) -> float:
    """Median kernel time (do_bench: L2 flushed between launches, which also lets the host catch up)."""
    return triton.testing.do_bench(launch, warmup=10, rep=30)


def _choose(
    kernel: str, launch: Callable[[TileConfig], None], key: tuple, candidates: tuple[TileConfig, ...]
) -> TileConfig:
    """The config for ``key``: forced, the heuristic default, or the fastest candidate (timed once)."""
    if kernel in _TUNE.forced:
        return _TUNE.forced[kernel]
    cfg = _TUNE.cache.get(key)
    if cfg is not None:
        return cfg
    if not AUTOTUNE or INTERPRET or len(candidates) == 1:
        return candidates[0]
    if not _TUNE.loaded:
        _load_disk_cache()
        if key in _TUNE.cache:
            return _TUNE.cache[key]
    start = time.perf_counter()
    timings = {}
    for c in candidates:
        # A candidate that fails to build or launch here is skipped, and reported.
        try:
            measure = _device_time_ms if TUNE_METRIC == "device" else _launch_time_ms
            timings[str(c)] = measure(lambda c=c: launch(c))
        except Exception as exc:
            timings[str(c)] = math.inf
            reason = str(exc).strip().splitlines()[-1][:200]
            _TUNE.errors[f"{_key_str(key)}|{c}"] = f"{type(exc).__name__}: {reason}"
    cfg = min(candidates, key=lambda c: timings[str(c)])
    if math.isinf(timings[str(cfg)]):
        raise RuntimeError(f"no candidate config builds for {_key_str(key)}: {_TUNE.errors}")
    _TUNE.timings[key] = timings
    _TUNE.cache[key] = cfg
    _TUNE.tune_seconds += time.perf_counter() - start
    _save_disk_cache()
    return cfg


# ----------------------------------------------------------------------------------------------------------
# Launchers on (batch, heads, seq, d) tensors of any strides
# ----------------------------------------------------------------------------------------------------------


# Compiled kernels by call signature: the model calls the same three launches 2 x layers times per step,
# and Triton's JIT dispatch (binding ~40 arguments, specializing each, building a cache key) costs more
# host time than the launch itself.
_COMPILED: dict[tuple, Any] = {}


def _signature(args: tuple) -> tuple:
    """What Triton specializes a compiled kernel on, for our argument kinds: every integer's value (we
    pass only shapes and strides, which repeat call after call), each tensor's dtype and 16-byte alignment
    and each descriptor's block shape (its other fields are integers passed at launch)."""
    sig = []
    for a in args:
        if isinstance(a, torch.Tensor):
            sig.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, TensorDescriptor):
            sig.append((a.base.dtype, tuple(a.block_shape)))
        elif isinstance(a, float):
            sig.append(float)
        else:
            sig.append(a)
    return tuple(sig)


def _launch(fn: Any, grid: tuple[int, int], args: tuple, c: TileConfig, constexprs: tuple) -> None:
    """``fn[grid](*args, *constexprs)`` with ``c``'s warps and stages: through Triton's JIT the first time
    for this signature, then straight through the compiled kernel's launcher."""
    key = (fn, grid, c, constexprs, _signature(args)) if DIRECT_LAUNCH and not INTERPRET else None
    compiled = _COMPILED.get(key) if key is not None else None
    if compiled is None:
        compiled = fn[grid](*args, *constexprs, num_warps=c.num_warps, num_stages=c.num_stages)
        if key is not None:
            _COMPILED[key] = compiled
        return
    stream = torch._C._cuda_getCurrentRawStream(torch.cuda.current_device())
    compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *constexprs)  # fmt: skip


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides and a unit last stride."""
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or t.stride(3) != 1:
            return False
        if (t.stride(0) * size) % 16 or (t.stride(1) * size) % 16 or (t.stride(2) * size) % 16:
            return False
    return True


def _rows(t: torch.Tensor, rows: int, use_tma: bool):
    """What a kernel gets for a (batch, heads, N, d) tensor: a descriptor of [1, 1, rows, BLOCK_D] boxes,
    or the tensor itself."""
    if not use_tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, _bucket(t.shape[3])])


def new_output(q: torch.Tensor) -> torch.Tensor:
    """O for a (batch, heads, n, d) Q, stored as (batch, n, heads, d): the model's
    ``out.transpose(1, 2).reshape(batch, n, heads * d)`` is then a view, not a copy."""
    batch, heads, n, d = q.shape
    return q.new_empty((batch, n, heads, d)).transpose(1, 2)


# Names of the kernels' trailing constexpr parameters, in the order the launchers pass them.
_CONSTEXPRS = ("D", "Q_TILE_SIZE", "K_TILE_SIZE", "is_causal", "BLOCK_D", "USE_TMA")


def _launch_traced(fn: Any, grid: tuple[int, int], args: tuple, c: TileConfig, constexprs: tuple) -> None:
    """The launch as ``torch.library.wrap_triton`` sees it: inside a ``triton_op`` under torch.compile,
    inductor puts the kernel into its own generated code, so the compiled model launches it with no
    Python of ours on the way (and CUDA graphs can capture it)."""
    from torch.library import wrap_triton

    meta = dict(zip(_CONSTEXPRS, constexprs, strict=True))
    wrap_triton(fn)[grid](*args, **meta, num_warps=c.num_warps, num_stages=c.num_stages)


@functools.cache
def pointer_configs(kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates of ``kernel`` with block pointers only: what the inlined (traced) path tunes over,
    since a descriptor is built from the tensor's data pointer on the host."""
    return tuple(dict.fromkeys(replace(c, tma=False) for c in candidate_configs(kernel, d, dtype)))


@dataclass(frozen=True)
class _Mode:
    """How a launcher picks and launches: the tuned candidates and direct launches (default), or the
    block-pointer candidates (``pointers``) launched through ``wrap_triton`` (``traced``)."""

    pointers: bool = False
    traced: bool = False

    def kernel_key(self, kernel: str) -> str:
        return f"{kernel}-ptr" if self.pointers else kernel

    def candidates(self, kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
        return (pointer_configs if self.pointers else candidate_configs)(kernel, d, dtype)

    def launch(self, fn: Any, grid: tuple[int, int], args: tuple, c: TileConfig, constexprs: tuple) -> None:
        (_launch_traced if self.traced else _launch)(fn, grid, args, c, constexprs)


_DIRECT = _Mode()
_POINTERS = _Mode(pointers=True)
_TRACED = _Mode(pointers=True, traced=True)


def _pick(
    kernel: str,
    mode: _Mode,
    launch: Callable[[TileConfig], None],
    bh: int,
    n_q: int,
    n_k: int,
    d: int,
    is_causal: bool,
    dtype: torch.dtype,
) -> TileConfig:
    key = _tune_key(mode.kernel_key(kernel), bh, n_q, n_k, d, is_causal, dtype)
    cfg = _choose(kernel, launch, key, mode.candidates(kernel, d, dtype))
    return replace(cfg, tma=False) if mode.pointers and cfg.tma else cfg  # a forced TMA config


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, mode: _Mode = _DIRECT):
    """O (input dtype, layout of :func:`new_output`) and L (float32, contiguous (batch, heads, n_q)) for
    4-D (batch, heads, seq, d) inputs of any strides."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    o = new_output(q)
    lse = q.new_empty((batch, heads, n_q), dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    block_d = _bucket(d)

    def launch(c: TileConfig) -> None:
        tma = c.tma and _tma_ok(q, k, v, o)
        args = (
            _rows(q, c.q_tile, tma), _rows(k, c.k_tile, tma), _rows(v, c.k_tile, tma),
            _rows(o, c.q_tile, tma), lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(),
            heads, n_q, n_k, scale,
        )  # fmt: skip
        constexprs = (d, c.q_tile, c.k_tile, is_causal, block_d, tma)
        mode.launch(flash_fwd_kernel, (-(-n_q // c.q_tile), batch * heads), args, c, constexprs)

    launch(_pick("fwd", mode, launch, batch * heads, n_q, n_k, d, is_causal, q.dtype))
    return o, lse


def flash_backward(q, k, v, o, do, lse, is_causal: bool, mode: _Mode = _DIRECT):
    """dQ, dK, dV (input dtype) for 4-D inputs of any strides, L contiguous (batch, heads, n_q): the dQ
    pass (which also writes D = rowsum(dO ∘ O)), then the dK/dV pass. Two launches."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    scale = 1.0 / math.sqrt(d)
    block_d = _bucket(d)
    delta = torch.empty_like(lse)
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)

    def launch_dq(c: TileConfig) -> None:
        tma = c.tma and _tma_ok(q, k, v, do, dq)
        qt, kt = c.q_tile, c.k_tile
        args = (
            _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), o, _rows(do, qt, tma),
            lse, delta, _rows(dq, qt, tma),
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
            heads, n_q, n_k, scale,
        )  # fmt: skip
        constexprs = (d, qt, kt, is_causal, block_d, tma)
        mode.launch(flash_bwd_dq_kernel, (-(-n_q // qt), batch * heads), args, c, constexprs)

    def launch_dkdv(c: TileConfig) -> None:
        tma = c.tma and _tma_ok(q, k, v, do, dk, dv)
        qt, kt = c.q_tile, c.k_tile
        args = (
            _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), _rows(do, qt, tma),
            lse, delta, _rows(dk, kt, tma), _rows(dv, kt, tma),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
            heads, n_q, n_k, scale,
        )  # fmt: skip
        constexprs = (d, qt, kt, is_causal, block_d, tma)
        mode.launch(flash_bwd_dkdv_kernel, (-(-n_k // kt), batch * heads), args, c, constexprs)

    # dQ first: it writes D, which the dK/dV pass reads (tuning dK/dV below runs after a real dQ pass).
    case = (batch * heads, n_q, n_k, d, is_causal, q.dtype)
    launch_dq(_pick("dq", mode, launch_dq, *case))
    launch_dkdv(_pick("dkdv", mode, launch_dkdv, *case))
    return dq, dk, dv


# ----------------------------------------------------------------------------------------------------------
# The traced path: torch.library.triton_op bodies under torch.compile
# ----------------------------------------------------------------------------------------------------------


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A real tensor with ``t``'s shape, strides, dtype and device, filled with N(0, 1) values (the tuner
    times real launches; under tracing ``t`` is fake)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_()


def tune_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> None:
    """Tune the block-pointer configs of all three kernels for this case on real tensors of the same
    layout, outside any tracing mode: a traced launch bakes its config into the compiled graph, so the
    choice must exist when the graph is traced, not at its first run."""
    batch, heads, n_q, d = q.shape
    keys = [_tune_key(_POINTERS.kernel_key(kernel), batch * heads, n_q, k.shape[2], d, is_causal, q.dtype)
            for kernel in ("fwd", "dq", "dkdv")]  # fmt: skip
    if all(key in _TUNE.cache for key in keys) or not AUTOTUNE or INTERPRET:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        qr, kr, vr = (_real_like(t) for t in (q, k, v))
        o, lse = flash_forward(qr, kr, vr, is_causal, _POINTERS)
        flash_backward(qr, kr, vr, o, torch.randn_like(o), lse, is_causal, _POINTERS)


def flash_forward_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """:func:`flash_forward` for a ``triton_op`` body: tuned block-pointer configs, ``wrap_triton``."""
    tune_traced(q, k, v, is_causal)
    return flash_forward(q, k, v, is_causal, _TRACED)


def flash_backward_traced(q, k, v, o, do, lse, is_causal: bool):
    """:func:`flash_backward` for a ``triton_op`` body."""
    tune_traced(q, k, v, is_causal)
    return flash_backward(q, k, v, o, do, lse, is_causal, _TRACED)
