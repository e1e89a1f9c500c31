"""Triton kernels of FlashAttention-2 (D9b/c, D12) and their launchers.

Forward (Algorithm 1): grid (T_q, batch), one program per query tile, one pass over key tiles with an
online softmax in float32. Backward (Algorithm 2 split in two, no atomics): a preprocessing kernel for
D = rowsum(dO ∘ O), a dK/dV kernel (grid (T_k, batch), loops over query tiles) and a dQ kernel (grid
(T_q, batch), loops over key tiles); each recomputes P from L.

Speed tricks (handout 1.3.3): scores are kept in log2 units (exp2, with 1/sqrt(d)·log2(e) folded into one
multiply); with causal masking, key tiles past the diagonal are never visited, and the tiles that straddle
the diagonal run a masked copy of the loop while all others run without any index comparison; the causal
forward and dQ grids start with the heaviest query tiles; on Hopper, tiles move through tensor
descriptors (the TMA copy engine; block pointers where strides do not allow it); tile sizes, warps,
stages and descriptors-or-not are tuned per (kernel, seq bucket, d, causal, dtype) among a short
candidate list, timed once per key and cached (in memory, optionally in a JSON file).

Boundaries: sequence lengths need not be multiples of the tiles. Out-of-range rows load as zeros; in the
forward and dQ kernels the last key tile is masked explicitly (padding keys must add nothing to the
softmax); elsewhere zero padding alone makes padded rows contribute nothing (dO and D are zero there).
Head dims that are not powers of two are padded to the next one (zeros do not change dot products).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl
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
def _load_rows(X, stride_b, stride_n, stride_d, b, N, start, D: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + ROWS) of batch b of a (batch, N, D) tensor as a (ROWS, BLOCK_D) tile. Rows past
    N and head-dim padding read as zeros. X is a tensor descriptor (TMA: bounds checked by the copy
    engine) or a pointer (block pointer, bounds checked only where asked)."""
    if USE_TMA:
        x = X.load([b, start, 0]).reshape(ROWS, BLOCK_D)
    else:
        ptr = tl.make_block_ptr(X + b.to(tl.int64) * stride_b, shape=(N, D), strides=(stride_n, stride_d),
                                offsets=(start, 0), block_shape=(ROWS, BLOCK_D), order=(1, 0))
        if D == BLOCK_D:
            if CHECK_ROWS:  # noqa: SIM108
                x = tl.load(ptr, boundary_check=(0,), padding_option="zero")
            else:
                x = tl.load(ptr)
        else:
            x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
    return x


@triton.jit
def _store_rows(X, x, stride_b, stride_n, stride_d, b, N, start, D: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a (ROWS, BLOCK_D) tile at rows [start, start + ROWS) of batch b, dropping out-of-range parts."""
    if USE_TMA:
        X.store([b, start, 0], x.to(X.dtype).reshape(1, ROWS, BLOCK_D))
    else:
        ptr = tl.make_block_ptr(X + b.to(tl.int64) * stride_b, shape=(N, D), strides=(stride_n, stride_d),
                                offsets=(start, 0), block_shape=(ROWS, BLOCK_D), order=(1, 0))
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


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb, stride_vk,
              stride_vd, b, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
              BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASKED adds the causal bias and drops padding keys."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = _load_rows(K_ptr, stride_kb, stride_kk, stride_kd, b, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = _load_rows(V_ptr, stride_vb, stride_vk, stride_vd, b, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
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
    stride_qb, stride_qq, stride_qd,
    stride_kb, stride_kk, stride_kd,
    stride_vb, stride_vk, stride_vd,
    stride_ob, stride_oq, stride_od,
    stride_lb, stride_lq,
    N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """Algorithm 1 for one query tile of one batch element (grid (T_q, batch)). With USE_TMA the Q/K/V/O
    arguments are tensor descriptors instead of pointers (strides then unused)."""
    # Causal work grows with the query index: launch the heaviest tiles first so the tail is short.
    if is_causal:  # noqa: SIM108
        query_tile_index = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        query_tile_index = tl.program_id(0)
    b = tl.program_id(1)
    q_start = query_tile_index * Q_TILE_SIZE

    q = _load_rows(Q_ptr, stride_qb, stride_qq, stride_qd, b, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    qk_scale = scale * LOG2E  # scores in log2 units: exp2 instead of exp
    acc = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)

    unmasked_end, masked_end = _loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb,
                              stride_vk, stride_vd, b, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D,
                              K_TILE_SIZE, BLOCK_D, False, is_causal, USE_TMA)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb,
                              stride_vk, stride_vd, b, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D,
                              K_TILE_SIZE, BLOCK_D, True, is_causal, USE_TMA)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2  # back to natural-log units: L is the contract's logsumexp
    _store_rows(O_ptr, acc, stride_ob, stride_oq, stride_od, b, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                USE_TMA)
    L_block_ptr = tl.make_block_ptr(L_ptr + b.to(tl.int64) * stride_lb, shape=(N_QUERIES,),
                                    strides=(stride_lq,), offsets=(q_start,), block_shape=(Q_TILE_SIZE,),
                                    order=(0,))
    tl.store(L_block_ptr, lse, boundary_check=(0,))


# ----------------------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def flash_bwd_preprocess_kernel(
    O_ptr, dO_ptr, Delta_ptr,
    stride_ob, stride_oq, stride_od,
    stride_dob, stride_doq, stride_dod,
    stride_deltab, stride_deltaq,
    N_QUERIES,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """D = rowsum(dO ∘ O) in float32, once, so neither backward pass recomputes it per tile."""
    b = tl.program_id(1)
    q_start = tl.program_id(0) * Q_TILE_SIZE
    o = _load_rows(O_ptr, stride_ob, stride_oq, stride_od, b, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, False)
    do = _load_rows(dO_ptr, stride_dob, stride_doq, stride_dod, b, N_QUERIES, q_start, D, Q_TILE_SIZE,
                    BLOCK_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    tl.store(Delta_ptr + b.to(tl.int64) * stride_deltab + offs_q * stride_deltaq, delta,
             mask=offs_q < N_QUERIES)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qb, stride_qq, stride_qd, stride_dob,
               stride_doq, stride_dod, stride_lb, stride_lq, b, offs_k, lo, hi, N_QUERIES, qk_scale,
               D: tl.constexpr, Q_TILE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), on transposed (keys x queries) tiles
    so that both accumulate without transposes. Rows past the end load as zeros (Q, dO, L, D): their P is
    finite and they add nothing (dO = 0, D = 0)."""
    row_base = b.to(tl.int64) * stride_lb
    for start_q in range(lo, hi, Q_TILE_SIZE):
        offs_q = start_q + tl.arange(0, Q_TILE_SIZE)
        q = _load_rows(Q_ptr, stride_qb, stride_qq, stride_qd, b, N_QUERIES, start_q, D, Q_TILE_SIZE,
                       BLOCK_D, True, USE_TMA)
        do = _load_rows(dO_ptr, stride_dob, stride_doq, stride_dod, b, N_QUERIES, start_q, D, Q_TILE_SIZE,
                        BLOCK_D, True, USE_TMA)
        in_range = offs_q < N_QUERIES
        lse2 = tl.load(L_ptr + row_base + offs_q * stride_lq, mask=in_range, other=0.0) * LOG2E
        delta = tl.load(Delta_ptr + row_base + offs_q * stride_lq, mask=in_range, other=0.0)
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
    stride_qb, stride_qq, stride_qd,
    stride_kb, stride_kk, stride_kd,
    stride_vb, stride_vk, stride_vd,
    stride_dob, stride_doq, stride_dod,
    stride_lb, stride_lq,
    stride_dkb, stride_dkk, stride_dkd,
    stride_dvb, stride_dvk, stride_dvd,
    N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """First backward pass: one program per key tile (grid (T_k, batch)) accumulates dK and dV over query
    tiles. L and D share strides (both (batch, N_QUERIES) float32)."""
    b = tl.program_id(1)
    k_start = tl.program_id(0) * K_TILE_SIZE  # causal: low key tiles see the most queries and come first
    k = _load_rows(K_ptr, stride_kb, stride_kk, stride_kd, b, N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    v = _load_rows(V_ptr, stride_vb, stride_vk, stride_vd, b, N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    qk_scale = scale * LOG2E
    dk = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    if is_causal:
        # Query tiles before k_start see none of these keys, [k_start, k_start + K_TILE_SIZE) straddle the
        # diagonal, all later ones see every key of the tile.
        diag_end = tl.minimum(k_start + K_TILE_SIZE, N_QUERIES)
        dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qb, stride_qq, stride_qd,
                            stride_dob, stride_doq, stride_dod, stride_lb, stride_lq, b, offs_k, k_start,
                            diag_end, N_QUERIES, qk_scale, D, Q_TILE_SIZE, BLOCK_D, True, USE_TMA)
        lo = k_start + K_TILE_SIZE
    else:
        lo = 0
    dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, stride_qb, stride_qq, stride_qd,
                        stride_dob, stride_doq, stride_dod, stride_lb, stride_lq, b, offs_k, lo, N_QUERIES,
                        N_QUERIES, qk_scale, D, Q_TILE_SIZE, BLOCK_D, False, USE_TMA)
    _store_rows(dK_ptr, dk * scale, stride_dkb, stride_dkk, stride_dkd, b, N_KEYS, k_start, D, K_TILE_SIZE,
                BLOCK_D, USE_TMA)
    _store_rows(dV_ptr, dv, stride_dvb, stride_dvk, stride_dvd, b, N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D,
                USE_TMA)


@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb, stride_vk,
             stride_vd, b, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
             BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = _load_rows(K_ptr, stride_kb, stride_kk, stride_kd, b, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = _load_rows(V_ptr, stride_vb, stride_vk, stride_vd, b, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
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
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,
    stride_qb, stride_qq, stride_qd,
    stride_kb, stride_kk, stride_kd,
    stride_vb, stride_vk, stride_vd,
    stride_dob, stride_doq, stride_dod,
    stride_lb, stride_lq,
    stride_dqb, stride_dqq, stride_dqd,
    N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """Second backward pass: one program per query tile (grid (T_q, batch)) accumulates dQ over key tiles.
    L and D share strides."""
    if is_causal:  # noqa: SIM108
        query_tile_index = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        query_tile_index = tl.program_id(0)
    b = tl.program_id(1)
    q_start = query_tile_index * Q_TILE_SIZE
    q = _load_rows(Q_ptr, stride_qb, stride_qq, stride_qd, b, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    do = _load_rows(dO_ptr, stride_dob, stride_doq, stride_dod, b, N_QUERIES, q_start, D, Q_TILE_SIZE,
                    BLOCK_D, True, USE_TMA)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    in_range = offs_q < N_QUERIES
    row = b.to(tl.int64) * stride_lb + offs_q * stride_lq
    lse2 = tl.load(L_ptr + row, mask=in_range, other=0.0) * LOG2E
    delta = tl.load(Delta_ptr + row, mask=in_range, other=0.0)
    qk_scale = scale * LOG2E
    dq = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    unmasked_end, masked_end = _loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb, stride_vk,
                  stride_vd, b, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D, K_TILE_SIZE, BLOCK_D, False,
                  is_causal, USE_TMA)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, stride_kb, stride_kk, stride_kd, stride_vb, stride_vk,
                  stride_vd, b, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D, K_TILE_SIZE, BLOCK_D,
                  True, is_causal, USE_TMA)
    _store_rows(dQ_ptr, dq * scale, stride_dqb, stride_dqq, stride_dqd, b, N_QUERIES, q_start, D, Q_TILE_SIZE,
                BLOCK_D, USE_TMA)
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
        ("dkdv", False, True): [C(32, 64, 4, 3, T), C(64, 128, 8, 2, T), C(32, 64, 4, 4, T), C(32, 64, 4, 3)],
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
    cache: dict[str, TileConfig]
    timings: dict[str, dict[str, float]]
    forced: dict[str, TileConfig]
    errors: dict[str, str]
    loaded: bool = False


_TUNE = _TuneState(cache={}, timings={}, forced={}, errors={})


def _tune_key(kernel: str, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype) -> str:
    # Sequence lengths are bucketed to powers of two: ragged lengths share their bucket's choice.
    bq, bk = triton.next_power_of_2(n_q), triton.next_power_of_2(n_k)
    return f"{kernel}|q{bq}|k{bk}|d{d}|{'causal' if causal else 'full'}|{str(dtype).removeprefix('torch.')}"


def _load_disk_cache() -> None:
    _TUNE.loaded = True
    if not TUNE_CACHE_PATH or not os.path.exists(TUNE_CACHE_PATH):
        return
    with open(TUNE_CACHE_PATH) as f:
        for key, cfg in json.load(f).items():
            _TUNE.cache.setdefault(key, TileConfig(**cfg))


def _save_disk_cache() -> None:
    if TUNE_CACHE_PATH:
        with open(TUNE_CACHE_PATH, "w") as f:
            json.dump({k: asdict(v) for k, v in sorted(_TUNE.cache.items())}, f, indent=1)


def tuning_report() -> dict[str, Any]:
    """Chosen config, candidate timings (ms) per key, and why candidates failed to build, if any."""
    report = {k: {"chosen": str(v), "timings_ms": _TUNE.timings.get(k, {})} for k, v in _TUNE.cache.items()}
    return {"keys": report, "build_errors": dict(_TUNE.errors)}


def clear_tuning_cache() -> None:
    _TUNE.cache.clear()
    _TUNE.timings.clear()


def force_config(kernel: str, config: TileConfig | None) -> None:
    """Pin ``kernel`` ("fwd", "dkdv", "dq") to ``config`` (None unpins): tests check every candidate."""
    if config is None:
        _TUNE.forced.pop(kernel, None)
    else:
        _TUNE.forced[kernel] = config


def candidate_configs(kernel: str, d: int, dtype: torch.dtype) -> list[TileConfig]:
    return _candidates(kernel, triton.next_power_of_2(d), dtype)


def _launch(kernel: str, launch: Callable[[TileConfig], None], key_args: tuple) -> None:
    if kernel in _TUNE.forced:
        launch(_TUNE.forced[kernel])
        return
    d, dtype = key_args[2], key_args[4]
    candidates = candidate_configs(kernel, d, dtype)
    if not AUTOTUNE or INTERPRET or len(candidates) == 1:
        launch(candidates[0])
        return
    if not _TUNE.loaded:
        _load_disk_cache()
    key = _tune_key(kernel, *key_args)
    cfg = _TUNE.cache.get(key)
    if cfg is None:
        timings = {}
        for c in candidates:
            # A candidate that fails to build or launch here is skipped, and reported.
            try:
                timings[str(c)] = triton.testing.do_bench(lambda c=c: launch(c), warmup=5, rep=25)
            except Exception as exc:
                timings[str(c)] = math.inf
                reason = str(exc).strip().splitlines()[-1][:200]
                _TUNE.errors[f"{key}|{c}"] = f"{type(exc).__name__}: {reason}"
        cfg = min(candidates, key=lambda c: timings[str(c)])
        if math.isinf(timings[str(cfg)]):
            raise RuntimeError(f"no candidate config builds for {key}: {_TUNE.errors}")
        _TUNE.timings[key] = timings
        _TUNE.cache[key] = cfg
        _save_disk_cache()
    launch(cfg)


# ----------------------------------------------------------------------------------------------------------
# Launchers on (batch, seq, d) contiguous tensors
# ----------------------------------------------------------------------------------------------------------


def _tma_ok(*tensors: torch.Tensor) -> bool:
    """Tensor descriptors need 16-byte aligned bases and row strides and a unit last stride."""
    return all(
        t.data_ptr() % 16 == 0
        and t.stride(-1) == 1
        and all(s * t.element_size() % 16 == 0 for s in t.stride()[:-1])
        for t in tensors
    )


def _rows(t: torch.Tensor, rows: int, use_tma: bool):
    """What a kernel gets for a (batch, N, d) tensor: a descriptor of [1, rows, BLOCK_D] boxes, or itself."""
    if not use_tma:
        return t
    return TensorDescriptor(
        t, list(t.shape), list(t.stride()), [1, rows, triton.next_power_of_2(t.shape[-1])]
    )


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """O (input dtype) and L (float32, (batch, n_queries)) for 3-D inputs."""
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    o = torch.empty_like(q)
    lse = torch.empty((batch, n_q), device=q.device, dtype=torch.float32)
    scale = 1.0 / math.sqrt(d)
    tma_ok = _tma_ok(q, k, v, o)

    def launch(c: TileConfig) -> None:
        tma = c.tma and tma_ok
        flash_fwd_kernel[(triton.cdiv(n_q, c.q_tile), batch)](
            _rows(q, c.q_tile, tma), _rows(k, c.k_tile, tma), _rows(v, c.k_tile, tma),
            _rows(o, c.q_tile, tma), lse,
            *q.stride(), *k.stride(), *v.stride(), *o.stride(), *lse.stride(),
            n_q, n_k, scale,
            D=d, Q_TILE_SIZE=c.q_tile, K_TILE_SIZE=c.k_tile, is_causal=is_causal,
            BLOCK_D=triton.next_power_of_2(d), USE_TMA=tma, num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    _launch("fwd", launch, (n_q, n_k, d, is_causal, q.dtype))
    return o, lse


def flash_backward(q, k, v, o, do, lse, is_causal: bool):
    """dQ, dK, dV (input dtype) from L: preprocessing kernel for D, then the dK/dV and dQ passes."""
    batch, n_q, d = q.shape
    n_k = k.shape[1]
    scale = 1.0 / math.sqrt(d)
    block_d = triton.next_power_of_2(d)
    lse = lse.contiguous()
    delta = torch.empty_like(lse)  # same strides as L: the kernels index both with L's strides
    pre_tile = 64 if not INTERPRET else 32
    flash_bwd_preprocess_kernel[(triton.cdiv(n_q, pre_tile), batch)](
        o, do, delta, *o.stride(), *do.stride(), *delta.stride(), n_q,
        D=d, Q_TILE_SIZE=pre_tile, BLOCK_D=block_d,
    )  # fmt: skip
    dq = torch.empty_like(q)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    tma_ok = _tma_ok(q, k, v, do, dq, dk, dv)

    def launch_dkdv(c: TileConfig) -> None:
        tma = c.tma and tma_ok
        qt, kt = c.q_tile, c.k_tile
        flash_bwd_dkdv_kernel[(triton.cdiv(n_k, kt), batch)](
            _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), _rows(do, qt, tma),
            lse, delta, _rows(dk, kt, tma), _rows(dv, kt, tma),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dk.stride(), *dv.stride(),
            n_q, n_k, scale,
            D=d, Q_TILE_SIZE=qt, K_TILE_SIZE=kt, is_causal=is_causal, BLOCK_D=block_d, USE_TMA=tma,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    def launch_dq(c: TileConfig) -> None:
        tma = c.tma and tma_ok
        qt, kt = c.q_tile, c.k_tile
        flash_bwd_dq_kernel[(triton.cdiv(n_q, qt), batch)](
            _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), _rows(do, qt, tma),
            lse, delta, _rows(dq, qt, tma),
            *q.stride(), *k.stride(), *v.stride(), *do.stride(), *lse.stride(), *dq.stride(),
            n_q, n_k, scale,
            D=d, Q_TILE_SIZE=qt, K_TILE_SIZE=kt, is_causal=is_causal, BLOCK_D=block_d, USE_TMA=tma,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip

    key_args = (n_q, n_k, d, is_causal, q.dtype)
    _launch("dkdv", launch_dkdv, key_args)
    _launch("dq", launch_dq, key_args)
    return dq, dk, dv
