"""Triton kernels of FlashAttention-2 (D9b/c, D12) and their launchers.

Inputs are (batch, heads, seq, d) tensors of any strides (the model's V is a permuted view of its fused
QKV projection): every kernel takes four strides per tensor and a grid (tiles, batch * heads), so no
input is copied. O is written in (batch, seq, heads, d) memory order (returned as a (batch, heads, seq,
d) view), which makes the model's ``out.transpose(1, 2).reshape(...)`` free.

Forward (Algorithm 1): one program per query tile, one pass over key tiles with an online softmax in
float32. Backward (Algorithm 2), two ways, and the tuner times both as whole backwards:
- split, two launches, no atomics (deterministic): a dQ kernel (loops over key tiles) that also computes
  D = rowsum(dO ∘ O) for its rows and stores it, then a dK/dV kernel (loops over query tiles) that reads
  D; each recomputes P from L (seven matmuls per tile pair);
- one pass, three launches: D (and a zeroed float32 dQ accumulator), then the dK/dV kernel adding each
  tile pair's dS K to the accumulator (on Hopper a bulk reduction by the copy engine; five matmuls), then
  dQ's scaled cast. Its dQ depends on the order of the adds, so deterministic algorithms rule it out.

Speed tricks (handout 1.3.3): scores are kept in log2 units (exp2, with 1/sqrt(d)·log2(e) folded into one
multiply); with causal masking, key tiles past the diagonal are never visited, and the tiles that straddle
the diagonal run a masked copy of the loop while all others run without any index comparison; the causal
forward and dQ grids start with the heaviest query tiles; on Hopper, tiles move through tensor
descriptors (the TMA copy engine; block pointers where strides do not allow it, or where the host-side
cost of building descriptors outweighs the gain, which the tuner measures). Tile sizes, warps, stages and
descriptors-or-not are tuned per (kernel, batch x heads bucket, seq buckets, d, causal, dtype) among a
short candidate list, timed once per key (device plus host time per launch: short cases are host-bound;
the key's candidates first compile side by side in a thread pool) and cached (in memory, optionally in a
JSON file).

Launches: the model calls attention 2 x layers times per step, and at short sequences a call is
host-bound, so every call signature (shapes, strides, dtypes, alignment, device, causality) gets an
:class:`AttentionPlan` on its first call: the tuned configs and the compiled kernels, with their integer
arguments bound. Later calls of the signature allocate the outputs and hand the tensors to the compiled
kernels' launchers: no checks, tuning lookups, argument building or Triton JIT dispatch; descriptors are
encoded into CUDA tensor maps once per address, not on every launch.

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
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch
import triton
import triton.language as tl
import triton.testing
from triton.compiler.errors import CompilationError
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.runtime.errors import OutOfResources, PTXASError
from triton.tools.tensor_descriptor import TensorDescriptor

from . import flash_gluon

# Triton reads TRITON_INTERPRET when a kernel is decorated, so what counts is its value at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# "0" turns tuning off: each kernel then runs the first (heuristic) candidate for its case.
AUTOTUNE = os.environ.get("CS336_FLASH_AUTOTUNE", "1") != "0"
# Optional JSON file that keeps tuning results across processes (read at first use, rewritten on change).
TUNE_CACHE_PATH = os.environ.get("CS336_FLASH_TUNE_CACHE")
# "0": block pointers only, never tensor descriptors (an A/B knob: descriptors are built on the host per
# launch, which short, host-bound calls pay for).
TMA = os.environ.get("CS336_FLASH_TMA", "1") != "0"
# "wide": tune over a broad grid of tiles x warps x stages (slow; to find what the short lists should hold).
CANDIDATE_SET = os.environ.get("CS336_FLASH_CANDIDATES", "default")
# What the tuner minimises in eager calls: "launch" (default: per launch of back-to-back launches, their
# event time plus the host's enqueue time: what a host-bound call pays, see _launch_time_ms) or "device"
# (do_bench kernel time, L2 flushed between launches: what a GPU-bound step pays; it picks host-heavier TMA
# configs for short shapes). Kernels that a compiled graph launches (traced) or that a CUDA graph replays
# (graphed) always tune by "graph" (_graph_time_ms): there our launcher's host cost is not paid at all.
TUNE_METRIC = os.environ.get("CS336_FLASH_TUNE_METRIC", "launch")
if TUNE_METRIC not in ("launch", "device"):
    raise ValueError(f"CS336_FLASH_TUNE_METRIC must be 'launch' or 'device', got {TUNE_METRIC!r}")
# Threads that compile a key's candidates at once before tuning times them ("1": one after the other).
COMPILE_THREADS = int(os.environ.get("CS336_FLASH_COMPILE_THREADS", str(min(8, os.cpu_count() or 1))))

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


# Who launches a plan's kernels, which decides what its tuner measures and which configs it may use:
# - "eager": our launcher on every call (host time counts; any config);
# - "traced": the code of a compiled graph (device time; block pointers and the split backward only: a
#   descriptor is built from a data pointer, which a traced graph does not have);
# - "graphed": our launcher once, while a CUDA graph records it, then replays (device time; any config).
Launcher = Literal["eager", "traced", "graphed"]
LAUNCHERS: tuple[Launcher, ...] = ("eager", "traced", "graphed")


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
def _add_rows(X, x, off, bh, H, N, start, D: tl.constexpr, ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Atomically add a float32 (ROWS, BLOCK_D) tile to rows [start, start + ROWS) of head bh of a
    contiguous (batch, heads, N, D) float32 tensor, dropping out-of-range parts. With a descriptor, one bulk
    reduction by the copy engine (cp.reduce.async.bulk.tensor) instead of an atomic per element."""
    if USE_TMA:
        X.atomic_add([bh // H, bh % H, start, 0], x.reshape(1, 1, ROWS, BLOCK_D))
    else:
        rows = start + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK_D)
        ptrs = X + off + rows[:, None].to(tl.int64) * D + cols[None, :]
        tl.atomic_add(ptrs, x, mask=(rows[:, None] < N) & (cols[None, :] < D), sem="relaxed")


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_acc, off_q, stride_qq, stride_qd, off_do,
               stride_doq, stride_dod, bh, H, offs_k, lo, hi, N_QUERIES, qk_scale, D: tl.constexpr,
               Q_TILE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr, ATOMIC_DQ: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), on transposed (keys x queries) tiles
    so that both accumulate without transposes. Rows past the end load as zeros (Q, dO, L, D): their P is
    finite and they add nothing (dO = 0, D = 0). With ATOMIC_DQ, each query tile's share of dQ, dS K
    (unscaled), is added to the float32 accumulator dQ_acc: five matmuls per tile pair in one pass, where
    the separate dQ pass recomputes S and dP (seven)."""
    off_dq = bh.to(tl.int64) * N_QUERIES * D
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
        if ATOMIC_DQ:
            dq = _dot(tl.trans(ds_t.to(k.dtype)), k)
            _add_rows(dQ_acc, dq, off_dq, bh, H, N_QUERIES, start_q, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr, dQ_acc,
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
    ATOMIC_DQ: tl.constexpr = False,
):
    """Second backward pass: one program per key tile (grid (T_k, batch * heads)) accumulates dK and dV
    over query tiles. With ATOMIC_DQ (the one-pass backward) it also adds each tile pair's dS K to the
    float32 accumulator dQ_acc, which flash_bwd_preprocess_kernel zeroed (and wrote D for); without, dQ_acc
    is not read."""
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
        dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_acc, off_q, stride_qq,
                            stride_qd, off_do, stride_doq, stride_dod, bh, H, offs_k, k_start, diag_end,
                            N_QUERIES, qk_scale, D, Q_TILE_SIZE, BLOCK_D, True, USE_TMA, ATOMIC_DQ)
        lo = k_start + K_TILE_SIZE
    else:
        lo = 0
    dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_acc, off_q, stride_qq, stride_qd,
                        off_do, stride_doq, stride_dod, bh, H, offs_k, lo, N_QUERIES, N_QUERIES, qk_scale, D,
                        Q_TILE_SIZE, BLOCK_D, False, USE_TMA, ATOMIC_DQ)
    _store_rows(dK_ptr, dk * scale, _offset(bh, H, stride_dkb, stride_dkh), stride_dkk, stride_dkd, bh, H,
                N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
    _store_rows(dV_ptr, dv, _offset(bh, H, stride_dvb, stride_dvh), stride_dvk, stride_dvd, bh, H, N_KEYS,
                k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)



# ----------------------------------------------------------------------------------------------------------
# The one-pass backward's other two kernels: D (and the zeroed dQ accumulator) before the dK/dV pass with
# ATOMIC_DQ, and dQ's cast after it
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def flash_bwd_preprocess_kernel(
    O_ptr, dO_ptr, Delta_ptr, dQ_acc,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_dob, stride_doh, stride_doq, stride_dod,
    H, N_QUERIES,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """D = rowsum(dO ∘ O) for ROWS rows of one (batch, head) (grid (T, batch * heads)), and zeros in the
    same rows of the float32 dQ accumulator (contiguous (batch, heads, N_QUERIES, D)): the one-pass
    backward needs every row's D before any key tile starts, and adds into dQ_acc."""
    start = tl.program_id(0) * ROWS
    bh = tl.program_id(1)
    o = _load_rows(O_ptr, _offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES, start,
                   D, ROWS, BLOCK_D, True, False)
    do = _load_rows(dO_ptr, _offset(bh, H, stride_dob, stride_doh), stride_doq, stride_dod, bh, H, N_QUERIES,
                    start, D, ROWS, BLOCK_D, True, False)
    offs = start + tl.arange(0, ROWS)
    tl.store(Delta_ptr + bh.to(tl.int64) * N_QUERIES + offs, tl.sum(o.to(tl.float32) * do.to(tl.float32), 1),
             mask=offs < N_QUERIES)
    _store_rows(dQ_acc, tl.zeros((ROWS, BLOCK_D), dtype=tl.float32), bh.to(tl.int64) * N_QUERIES * D, D, 1,
                bh, H, N_QUERIES, start, D, ROWS, BLOCK_D, False)


@triton.jit
def flash_bwd_dq_cast_kernel(
    dQ_acc, dQ_ptr,
    stride_dqb, stride_dqh, stride_dqq, stride_dqd,
    H, N_QUERIES,
    scale,
    D: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """dQ = scale * dQ_acc in dQ's dtype and layout, ROWS rows of one (batch, head) per program."""
    start = tl.program_id(0) * ROWS
    bh = tl.program_id(1)
    acc = _load_rows(dQ_acc, bh.to(tl.int64) * N_QUERIES * D, D, 1, bh, H, N_QUERIES, start, D, ROWS,
                     BLOCK_D, True, False)
    scale = tl.cast(scale, tl.float32)  # see flash_fwd_kernel
    _store_rows(dQ_ptr, acc * scale, _offset(bh, H, stride_dqb, stride_dqh), stride_dqq, stride_dqd, bh, H,
                N_QUERIES, start, D, ROWS, BLOCK_D, False)
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
    # dK/dV only: the one-pass backward (dQ added atomically in the dK/dV pass, see _OnePassBackward).
    atomic_dq: bool = False
    # The Gluon (Hopper) kernel (kernels/flash_gluon.py) where it can run, else the Triton one with the same
    # tiles. For the forward and dQ, num_stages is the depth of its K/V ring.
    gluon: bool = False

    def __str__(self) -> str:
        tma, adq = "-tma" if self.tma else "", "-adq" if self.atomic_dq else ""
        gluon = "-gluon" if self.gluon else ""
        return f"q{self.q_tile}-k{self.k_tile}-w{self.num_warps}-s{self.num_stages}{tma}{adq}{gluon}"


def _candidates(kernel: str, d: int, dtype: torch.dtype) -> list[TileConfig]:
    """Short lists per (kernel, 4-byte dtype?, d > 64?), best first (the default when tuning is off), from
    the H100 sweeps in docs/notes/attention-kernels.md. "-tma" configs fall back to block pointers with the
    same tiles where descriptors are not possible (misaligned strides). Constraints: forward and dQ need
    q_tile % k_tile == 0, dK/dV needs k_tile % q_tile == 0 (diagonal tiles line up with the loop steps)."""
    C = TileConfig
    if INTERPRET:
        # Small tiles so that the tiny CPU test shapes still span several tiles and every loop phase.
        adq = C(16, 32, atomic_dq=True)
        return {"fwd": [C(32, 16)], "dkdv": [C(16, 32), adq], "dq": [C(32, 16)]}[kernel]
    if CANDIDATE_SET == "wide":
        return _wide_candidates(kernel)
    return gpu_candidates(kernel, d, dtype)


def gpu_candidates(kernel: str, d: int, dtype: torch.dtype) -> list[TileConfig]:
    """The short lists that tuning uses on a GPU (also readable under the interpreter, which tunes over
    its own small tiles)."""
    C = TileConfig
    wide = dtype == torch.float32  # 4-byte elements: twice the shared memory and registers per tile
    big_d = d > 64
    T = True  # tensor descriptors
    A = True  # dK/dV: the one-pass backward, dQ added atomically

    # The Gluon kernel (Triton's q-k-w-s-tma where it cannot run)
    def G(q: int, k: int, w: int, s: int = 2, atomic_dq: bool = False) -> TileConfig:
        return C(q, k, w, s, T, atomic_dq, gluon=True)

    return {
        ("fwd", False, False): [
            C(64, 64, 4, 4, T),
            C(128, 64, 8, 3, T),
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3),
            # Gluon, S_j issued with P_{j-1} V_{j-1} and the softmax under it (s: the K/V ring's depth): 0.98-0.99x
            # the best Triton forward at (4, 25, 512) and (2, 16, 8192) non-causal, 1.02-1.11x elsewhere; at
            # d = 128 it lost everywhere (scripts/flash_gluon_probe.py, docs/perf-notes.md session 10).
            G(64, 64, 4, 3),
        ],
        ("fwd", False, True): [
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 64, 4, 4, T),
            C(128, 32, 4, 3, T),
            C(128, 128, 8, 3, T),  # (2, 32, 4096) causal: 0.540 vs 0.560 ms for q64-k64-w4-s3 (wide sweep)
        ],
        ("fwd", True, False): [C(128, 32, 8, 3, T), C(128, 64, 8, 2, T), C(64, 32, 4, 3, T)],
        ("fwd", True, True): [C(128, 32, 8, 2, T), C(128, 32, 8, 2), C(64, 32, 4, 2)],
        ("dkdv", False, False): [
            C(64, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(32, 64, 4, 3, T),
            C(32, 128, 4, 3, T),
            # One pass (dQ by descriptor reductions): backward 3.54 vs 3.67 ms at (1, 16, 16384), 0.456 vs
            # 0.489 at (1, 2, 16384), causal; other tiles and every d = 128 tile lost (one_pass_sweep).
            C(64, 64, 4, 4, T, A),
            # Gluon, S^T/dP^T issued together and the exponentials under dP^T: dK/dV 2.04 vs 2.34 ms at
            # (1, 16, 16384), 2.14 vs 2.25 at (2, 16, 8192) non-causal (scripts/flash_gluon_probe.py).
            G(64, 64, 4),
            G(32, 64, 4),
            # Gluon one pass (flash_bwd_one_pass_gluon_kernel): S and dP query-major, each tile's dS K reduced
            # into dQ by the copy engine. Backward 0.99x the split Gluon one at (1, 16, 16384), 1.01x at (2,
            # 16, 8192) non-causal, 1.06-1.12x elsewhere; two warp groups per 128 keys lost 1.14-1.27x. At
            # d = 128 it spills and lost 1.12-1.18x (scripts/flash_one_pass_sweep.py, perf-notes session 12).
            G(64, 64, 4, atomic_dq=True),
        ],
        ("dkdv", False, True): [
            C(32, 64, 4, 3, T),
            C(64, 128, 8, 2, T),
            C(32, 64, 4, 4, T),
            C(32, 128, 4, 3, T),  # the Triton tutorial's dK/dV tiles
            C(64, 128, 8, 3, T),  # 32k causal: backward -2.8 ms vs q32-k64-w4-s3 (issue 17)
            C(64, 64, 4, 2, T),  # (2, 32, 4096) causal: 0.938 vs 1.062 ms for q32-k64-w4-s4 (wide sweep)
            G(64, 64, 4),  # 32k causal: dK/dV 26.96 vs 30.36 ms (scripts/flash_gluon_probe.py)
            G(64, 128, 8),
        ],
        ("dkdv", True, False): [C(32, 128, 8, 2, T), C(32, 64, 4, 2, T), C(32, 128, 8, 3, T)],
        ("dkdv", True, True): [C(32, 32, 4, 2), C(16, 64, 4, 2, T), C(32, 32, 4, 2, T)],
        ("dq", False, False): [
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 32, 4, 3, T),
            # Gluon, S_j and dP_j issued with dS_{j-1} K_{j-1} (P_j under dP_j, dS_j under dS_{j-1} K_{j-1}):
            # 0.83x the best Triton dQ at (1, 2, 16384), 0.99x at (4, 25, 512), 1.04-1.24x elsewhere; at
            # d = 128 it lost everywhere (scripts/flash_gluon_probe.py).
            G(64, 64, 4, 3),
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


def _eager_keys(batch_heads: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype) -> dict:
    """Each kernel's tuning key and candidates for this case in eager calls."""
    out = {}
    for kernel in ("fwd", "dq", "dkdv"):
        name, candidates = _tune_space(kernel, "eager", d, dtype)
        out[kernel] = (_tune_key(name, batch_heads, n_q, n_k, d, causal, dtype), candidates)
    return out


def chosen_configs(
    batch_heads: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype
) -> dict[str, str]:
    """The config each kernel uses for this case in eager calls (tuned, forced or default), for bench
    rows."""
    keys = _eager_keys(batch_heads, n_q, n_k, d, causal, dtype)
    return {
        kernel: str(_TUNE.forced.get(kernel) or _TUNE.cache.get(key) or candidates[0])
        for kernel, (key, candidates) in keys.items()
    }


def candidate_timings(
    batch_heads: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype
) -> dict[str, dict[str, float]]:
    """The tuner's ms per candidate of each kernel for this case (empty where it did not tune in this
    process: a disk-cache hit, a forced config, tuning off), for bench rows: why a config won."""
    keys = _eager_keys(batch_heads, n_q, n_k, d, causal, dtype)
    return {kernel: dict(_TUNE.timings.get(key, {})) for kernel, (key, _) in keys.items()}


def clear_plans() -> None:
    """Forget every call signature's plan (the next call of each is planned, and tuned, again)."""
    _PLANS.clear()


def clear_tuning_cache() -> None:
    clear_plans()
    _TUNE.cache.clear()
    _TUNE.timings.clear()
    _TUNE.tune_seconds = 0.0


def force_config(kernel: str, config: TileConfig | None) -> None:
    """Pin ``kernel`` ("fwd", "dkdv", "dq") to ``config`` (None unpins): tests check every candidate.
    Plans made before keep the configs they were made with, so they are dropped."""
    clear_plans()
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
    """Milliseconds per launch of back-to-back launches (one round of ~``budget_ms``): their CUDA-event time
    per launch (the larger of device and host time) plus the host's enqueue time per launch. A short case's
    call is host-bound as a whole (autograd, allocations and the other launches add host time: at
    (4, 25, 512, 64) on an H100 one fwd+bwd with descriptors in all three kernels took ~300 us of host
    time, against ~160 us for a Python autograd.Function that launches nothing), so a launch's host cost
    counts even where one kernel alone looks device-bound; for long cases it is noise next to
    milliseconds of kernel. (do_bench would flush L2 between launches, which also lets the host
    catch up and hides host cost.)"""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    launch()
    end.record()
    end.synchronize()
    reps = max(1, min(20, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
    start.record()
    host_start = time.perf_counter()
    for _ in range(reps):
        launch()
    host_ms = (time.perf_counter() - host_start) * 1e3
    end.record()
    end.synchronize()
    return (start.elapsed_time(end) + host_ms) / reps


def _device_time_ms(launch: Callable[[], None]) -> float:
    """Median kernel time (do_bench: L2 flushed between launches, which also lets the host catch up)."""
    return triton.testing.do_bench(launch, warmup=10, rep=30)


def _graph_time_ms(launch: Callable[[], None], budget_ms: float = 2.0) -> float:
    """Milliseconds per launch of ~``budget_ms`` of back-to-back launches captured in a CUDA graph and
    replayed: device time only, L2 warm. What a compiled model pays for a traced kernel: inductor's code (or
    its CUDA graph) launches it at a host cost no config changes, and the model's attention inputs were just
    written by the QKV projection. The launch-time metric would rank a short kernel by our launcher's host
    time instead, which that model never pays. (Not triton's do_bench_cudagraph: torch.cuda.graph runs a
    full garbage collection per capture, 0.1-0.3 s in a compiling process, and tuning captures once per
    candidate and round.)"""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        start.record()
        launch()
        end.record()
        end.synchronize()
        reps = max(1, min(200, int(budget_ms / max(start.elapsed_time(end), 1e-3))))
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(capture_error_mode="thread_local")
        for _ in range(reps):
            launch()
        graph.capture_end()
        graph.replay()  # first replay uploads the graph
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    return start.elapsed_time(end) / reps


TUNE_ROUNDS = 3


def _choose(
    kernel: str,
    launch: Callable[[TileConfig], None],
    key: tuple,
    candidates: tuple[TileConfig, ...],
    calls: Callable[[TileConfig], list[_Call]] | None = None,
    metric: str | None = None,
) -> TileConfig:
    """The config for ``key``: forced, the heuristic default, or the fastest candidate by ``metric`` ("launch",
    "device" or "graph"; default TUNE_METRIC), tuned once per key and process, or read from the disk cache.

    Every candidate is built (compiled, launched once) before any is timed; ``calls`` (a candidate's
    kernel launches) lets the compiles run side by side first. Then they are timed in
    interleaved rounds with the order rotated per round, and each candidate's median round counts.
    Compiles leave the GPU idle for seconds, so a candidate
    timed right after its own compile ran on clocks still ramping up, and candidates timed one after the
    other saw different clocks and host speeds: near-ties went whichever way the drift went."""
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
    timings = {str(c): math.inf for c in candidates}
    if calls is not None:
        _compile_side_by_side(candidates, calls)
    steps = {c: _guarded(key, c, launch) for c in candidates}
    built = {c: step for c, step in steps.items() if _builds(step)}
    if built:
        torch.cuda.synchronize()
        _warm_clocks(next(iter(built.values())))
        rounds: dict[TileConfig, list[float]] = {c: [] for c in built}
        order = list(built)
        for r in range(TUNE_ROUNDS):  # the order rotated per round: no candidate always goes first
            for c in order[r % len(order) :] + order[: r % len(order)]:
                rounds[c].append(_tuning_round(built[c], metric or TUNE_METRIC))
        timings.update({str(c): statistics.median(t) for c, t in rounds.items()})
    cfg = min(candidates, key=lambda c: timings[str(c)])
    if math.isinf(timings[str(cfg)]):
        raise RuntimeError(f"no candidate config builds for {_key_str(key)}: {_TUNE.errors}")
    _TUNE.timings[key] = timings
    _TUNE.cache[key] = cfg
    _TUNE.tune_seconds += time.perf_counter() - start
    _save_disk_cache()
    return cfg


def _compile_side_by_side(
    candidates: tuple[TileConfig, ...], calls: Callable[[TileConfig], list[_Call]]
) -> None:
    """Compile the candidates' kernels in a thread pool (Triton's AsyncCompileMode), so that building them
    one by one finds them compiled. A cold key's tuning is mostly compiles, each ~0.5 s of a single
    core, and ptxas and most of the MLIR passes run outside the GIL. A candidate that fails to compile
    here is compiled again when it is built, which records why it fails."""
    if COMPILE_THREADS < 2 or INTERPRET or len(candidates) < 2:
        return
    with ThreadPoolExecutor(COMPILE_THREADS) as pool, triton.AsyncCompileMode(pool, ignore_errors=True):
        for c in candidates:
            try:
                for call in calls(c):
                    call.warmup()
            except Exception:  # the candidate's own build reports it
                continue


class _CandidateFailed(Exception):
    """A candidate config failed to build or launch (the reason is in tuning_report()'s build_errors)."""


def _guarded(key: tuple, c: TileConfig, launch: Callable[[TileConfig], None]) -> Callable[[], None]:
    """``launch(c)`` that records why it failed, for tuning_report(), and raises _CandidateFailed."""

    def run() -> None:
        try:
            launch(c)
        except Exception as exc:
            reason = str(exc).strip().splitlines()[-1][:200]
            _TUNE.errors[f"{_key_str(key)}|{c}"] = f"{type(exc).__name__}: {reason}"
            raise _CandidateFailed from exc

    return run


def _builds(step: Callable[[], None]) -> bool:
    """Compile and launch a candidate once; one that fails is skipped by tuning."""
    try:
        step()
    except _CandidateFailed:
        return False
    return True


def _tuning_round(step: Callable[[], None], metric: str) -> float:
    """One round of one candidate: ms per launch by ``metric`` (inf if it fails)."""
    measure = {"launch": _launch_time_ms, "device": _device_time_ms, "graph": _graph_time_ms}[metric]
    try:
        return measure(step)
    except _CandidateFailed:
        return math.inf


def _warm_clocks(launch: Callable[[], None], ms: float = 20.0) -> None:
    """Keep the GPU busy for ~``ms`` (one launch at a time: a long kernel is not queued many times over)
    so that timing starts on boosted clocks, not idle ones."""
    deadline = time.perf_counter() + ms / 1e3
    while time.perf_counter() < deadline:
        launch()
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------
# Launches: one call's arguments (_Call), one kernel compiled for a call signature (_KernelPlan), and the
# plan of a whole attention call (AttentionPlan)
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Call:
    """One kernel launch: leading tensors (or tensor descriptors), then integers and the scale, then the
    constexprs by name, in the kernel's parameter order."""

    fn: Any
    grid: tuple[int, int]
    args: tuple
    constexprs: dict[str, Any]
    config: TileConfig

    def jit(self) -> Any:
        """Launch through Triton's JIT (compiling on first use); the compiled kernel (None when
        interpreted)."""
        return self.launch_with(self.fn)

    def warmup(self) -> None:
        """Compile without launching (under AsyncCompileMode: submit the compile and return)."""
        c = self.config
        self.fn.warmup(
            *self.args, grid=self.grid, **self.constexprs, num_warps=c.num_warps, num_stages=c.num_stages
        )

    def traced(self) -> None:
        """The launch as ``torch.library.wrap_triton`` sees it: inside a ``triton_op`` under torch.compile,
        inductor puts the kernel into its own generated code (and CUDA graphs can capture it)."""
        from torch.library import wrap_triton

        self.launch_with(wrap_triton(self.fn))

    def launch_with(self, fn: Any) -> Any:
        """``fn[grid]`` (the JIT function or its ``wrap_triton``) with this call's arguments, constexprs,
        warps and stages."""
        c = self.config
        return fn[self.grid](*self.args, **self.constexprs, num_warps=c.num_warps, num_stages=c.num_stages)


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


def _tiles(c: TileConfig, d: int, is_causal: bool, tma: bool) -> dict[str, Any]:
    """The trailing constexprs of the forward, dQ and dK/dV kernels."""
    return dict(D=d, Q_TILE_SIZE=c.q_tile, K_TILE_SIZE=c.k_tile, is_causal=is_causal, BLOCK_D=_bucket(d),
                USE_TMA=tma)  # fmt: skip


def _gluon_call(fn: Any, c: TileConfig, is_causal: bool, d: int, n_q: int, bh: int, args: tuple) -> _Call:
    """A forward or dQ launch of a Gluon kernel: one program per query tile and (batch, head)."""
    constexprs = dict(D=d, BM=c.q_tile, BN=c.k_tile, is_causal=is_causal, WARPS=c.num_warps,
                      STAGES=c.num_stages)  # fmt: skip
    return _Call(fn, (n_q // c.q_tile, bh), args, constexprs, c)


def _fwd_call(c: TileConfig, is_causal: bool, q, k, v, o, lse) -> _Call:
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    if c.gluon and flash_gluon.gluon_supported("fwd", c.q_tile, c.k_tile, q, k, v, stats=(lse,), o=o):
        args = flash_gluon.fwd_gluon_args(c.q_tile, c.k_tile, q, k, v, o, lse)
        return _gluon_call(flash_gluon.flash_fwd_gluon_kernel, c, is_causal, d, n_q, batch * heads, args)
    tma = c.tma and _tma_ok(q, k, v, o)
    args = (
        _rows(q, c.q_tile, tma), _rows(k, c.k_tile, tma), _rows(v, c.k_tile, tma), _rows(o, c.q_tile, tma), lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    grid = (-(-n_q // c.q_tile), batch * heads)
    return _Call(flash_fwd_kernel, grid, args, _tiles(c, d, is_causal, tma), c)


def _dq_call(c: TileConfig, is_causal: bool, q, k, v, o, do, lse, delta, dq) -> _Call:
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    tma = c.tma and _tma_ok(q, k, v, do, dq)
    qt, kt = c.q_tile, c.k_tile
    if c.gluon and flash_gluon.gluon_supported("dq", qt, kt, q, k, v, do, dq, stats=(lse, delta), o=o):
        args = flash_gluon.dq_gluon_args(qt, kt, q, k, v, o, do, lse, delta, dq)
        return _gluon_call(flash_gluon.flash_bwd_dq_gluon_kernel, c, is_causal, d, n_q, batch * heads, args)
    args = (
        _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), o, _rows(do, qt, tma), lse, delta,
        _rows(dq, qt, tma),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    grid = (-(-n_q // qt), batch * heads)
    return _Call(flash_bwd_dq_kernel, grid, args, _tiles(c, d, is_causal, tma), c)


def _dkdv_call(c: TileConfig, is_causal: bool, q, k, v, do, lse, delta, dk, dv, dq_acc=None) -> _Call:
    """The dK/dV pass; given ``dq_acc`` (the one-pass backward), it also adds dQ's shares into it. The
    split backward passes dK there, which the kernel then never reads (the argument list is fixed)."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    one_pass = dq_acc is not None
    qt, kt = c.q_tile, c.k_tile
    tensors = (q, k, v, do, lse, delta, dk, dv)
    float32 = (lse, delta, dq_acc) if one_pass else (lse, delta)
    if (
        c.gluon
        and (not one_pass or flash_gluon.one_pass_tiles(qt, kt, c.num_warps))
        and flash_gluon.gluon_supported("dkdv", qt, kt, q, k, v, do, dk, dv, stats=float32)
    ):
        args = flash_gluon.dkdv_gluon_args(qt, kt, *tensors, dq_acc=dq_acc)
        constexprs = dict(D=d, BM=qt, BN=kt, is_causal=is_causal, WARPS=c.num_warps)
        grid = (n_k // kt, batch * heads)
        fn = (
            flash_gluon.flash_bwd_one_pass_gluon_kernel
            if one_pass
            else flash_gluon.flash_bwd_dkdv_gluon_kernel
        )
        return _Call(fn, grid, args, constexprs, c)
    # Triton 3.6's interpreter has no descriptor reductions: there, the one-pass backward uses pointers.
    tma = c.tma and _tma_ok(q, k, v, do, dk, dv) and not (one_pass and (INTERPRET or not _tma_ok(dq_acc)))
    args = (
        _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), _rows(do, qt, tma), lse, delta,
        _rows(dk, kt, tma), _rows(dv, kt, tma), _rows(dq_acc, qt, tma) if one_pass else dk,
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    grid = (-(-n_k // kt), batch * heads)
    return _Call(
        flash_bwd_dkdv_kernel, grid, args, {**_tiles(c, d, is_causal, tma), "ATOMIC_DQ": one_pass}, c
    )


# Rows per program of the one-pass backward's elementwise kernels (D and zeroing, dQ's cast).
_ROWS = TileConfig(64, 64, num_warps=4, num_stages=1)


def _preprocess_call(o, do, delta, dq_acc) -> _Call:
    batch, heads, n_q, d = o.shape
    args = (o, do, delta, dq_acc, *o.stride(), *do.stride(), heads, n_q)
    grid = (-(-n_q // _ROWS.q_tile), batch * heads)
    constexprs = dict(D=d, ROWS=_ROWS.q_tile, BLOCK_D=_bucket(d))
    return _Call(flash_bwd_preprocess_kernel, grid, args, constexprs, _ROWS)


def _cast_call(dq_acc, dq, prescaled: bool = False) -> _Call:
    """dQ from the one-pass accumulator: scaled here unless the dK/dV pass added ``prescaled`` shares."""
    batch, heads, n_q, d = dq.shape
    args = (dq_acc, dq, *dq.stride(), heads, n_q, 1.0 if prescaled else 1.0 / math.sqrt(d))
    grid = (-(-n_q // _ROWS.q_tile), batch * heads)
    constexprs = dict(D=d, ROWS=_ROWS.q_tile, BLOCK_D=_bucket(d))
    return _Call(flash_bwd_dq_cast_kernel, grid, args, constexprs, _ROWS)


def _descriptor(base: torch.Tensor, box: tuple) -> TensorDescriptor:
    """A tensor descriptor of a layout its plan checked once (``TensorDescriptor``'s own checks cost more
    host time than the launch)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.padding = base, "zero"
    desc.shape, desc.strides, desc.block_shape = box
    return desc


class _KernelPlan:
    """One kernel compiled for one call signature (shapes, strides, dtypes, alignment, config): a launch
    hands only the call's device addresses (and descriptors) to the compiled kernel's launcher. Triton's JIT
    dispatch would bind and specialize ~40 arguments and build a cache key per launch, which costs more
    host time than the launch itself; the model launches attention kernels 3 x layers times per step."""

    __slots__ = ("boxes", "compiled", "encoded", "grid", "launch", "launch_jit", "prefix", "tail", "tma_meta")

    def __init__(self, call: _Call):
        """Launches ``call`` once through the JIT (compiling it) and keeps what later launches reuse."""
        descriptors = (TensorDescriptor, GluonTensorDescriptor)
        n = next(i for i, a in enumerate(call.args) if not isinstance(a, (torch.Tensor, *descriptors)))
        boxes = tuple(
            (a.shape, a.strides, a.block_shape) if isinstance(a, descriptors) else None for a in call.args[:n]
        )
        self.boxes = boxes if any(boxes) else None
        self.tail = (*call.args[n:], *call.constexprs.values())
        self.grid = call.grid
        self.compiled = k = call.jit()  # None under the interpreter, which always goes through the JIT
        c = call.config
        self.launch_jit = (
            None
            if k is not None
            else functools.partial(call.fn[call.grid], num_warps=c.num_warps, num_stages=c.num_stages)
        )
        self.launch, self.prefix, self.tma_meta, self.encoded = None, (), None, ()
        run = getattr(k, "run", None)
        if (
            run is not None
            and getattr(run, "global_scratch_size", 1) == 0
            and getattr(run, "profile_scratch_size", 1) == 0
        ):
            # The launcher's C entry point: its Python wrapper builds scratch-allocation closures on every
            # call, for kernels that have no scratch.
            self.launch = run.launch
            self.prefix = (
                run.launch_cooperative_grid,
                run.launch_pdl,
                None,
                None,
                k.packed_metadata,
                None,
                None,
                None,
            )
            self._bypass_descriptor_encoding(k)

    def _bypass_descriptor_encoding(self, k: Any) -> None:
        """For a kernel with descriptors, Triton's launcher encodes each one into a CUDA tensor map on the
        host (``cuTensorMapEncodeTiled``) on every launch: a few microseconds each, up to four per launch.
        A map depends only on the address once the plan fixed the layout, and a training loop's caching
        allocator hands the same addresses back step after step, so maps are kept per address and the
        launcher's C entry point underneath that wrapper gets them ready-made."""
        if self.boxes is None:
            return
        metas = getattr(k.metadata, "tensordesc_meta", None)
        closure = getattr(self.launch, "__closure__", None) or ()
        cells = dict(
            zip(getattr(getattr(self.launch, "__code__", None), "co_freevars", ()), closure, strict=False)
        )
        raw = cells.get("launcher")
        if not metas or raw is None or any(m is None for m in metas):
            return  # descriptors lowered without TMA, or another Triton: keep its wrapper
        self.launch = raw.cell_contents
        self.tma_meta = tuple(metas)
        self.encoded = tuple({} for _ in metas)

    def _encode(self, slot: int, t: torch.Tensor, box: tuple) -> list:
        """The launcher arguments of descriptor ``slot`` for ``t``: its tensor map, shape and strides."""
        from triton.backends.nvidia.driver import make_tensordesc_arg

        cache = self.encoded[slot]
        if len(cache) >= 64:  # addresses a long run no longer uses
            cache.clear()
        args = cache[t.data_ptr()] = make_tensordesc_arg(_descriptor(t, box), self.tma_meta[slot])
        return args

    def __call__(self, stream: int, *tensors: torch.Tensor) -> None:
        if self.compiled is None:
            if self.boxes is not None:
                tensors = tuple(
                    t if b is None else _descriptor(t, b) for t, b in zip(tensors, self.boxes, strict=True)
                )
            self.launch_jit(*tensors, *self.tail)
            return
        # Device addresses as integers: given a tensor, the launcher calls its data_ptr() and then
        # cuPointerGetAttribute to check the address, per tensor and launch (the plan checked the device).
        if self.boxes is None:
            args = [t.data_ptr() for t in tensors]
        elif self.tma_meta is None:
            args = [
                t.data_ptr() if b is None else _descriptor(t, b)
                for t, b in zip(tensors, self.boxes, strict=True)
            ]
        else:
            args, slot = [], 0
            for t, b in zip(tensors, self.boxes, strict=True):
                if b is None:
                    args.append(t.data_ptr())
                else:
                    args += self.encoded[slot].get(t.data_ptr()) or self._encode(slot, t, b)
                    slot += 1
        gx, gy = self.grid
        k = self.compiled
        if self.launch is not None:
            self.launch(gx, gy, 1, stream, k.function, *self.prefix, *args, *self.tail)
        else:
            k.run(gx, gy, 1, stream, k.function, k.packed_metadata, None, None, None, *args, *self.tail)


class _SplitBackward:
    """The dQ pass (which also writes D), then the dK/dV pass: two launches and no atomics, so the gradients
    are the same bit for bit on every run."""

    __slots__ = ("dkdv", "dq")

    def __init__(self, dq: _KernelPlan, dkdv: _KernelPlan):
        self.dq, self.dkdv = dq, dkdv

    @property
    def plans(self) -> tuple[_KernelPlan, ...]:
        return self.dq, self.dkdv

    def __call__(self, stream: int, q, k, v, o, do, lse, dq, dk, dv) -> None:
        delta = torch.empty_like(lse)
        self.dq(stream, q, k, v, o, do, lse, delta, dq)
        self.dkdv(stream, q, k, v, do, lse, delta, dk, dv, dk)


class _OnePassBackward:
    """D (and a zeroed float32 dQ accumulator), then one pass over key tiles that accumulates dK and dV and
    adds each tile pair's dS K to the accumulator, then dQ's scaled cast: three launches, and five matmuls
    per tile pair where the split backward does seven (its dQ pass recomputes S and dP). The adds land in
    any order, so dQ's last bits can differ between runs: with torch.use_deterministic_algorithms(True)
    only split backwards are used."""

    __slots__ = ("cast", "fused", "pre")

    def __init__(self, c: TileConfig, is_causal: bool, q, k, v, o, do, lse, dq, dk, dv):
        """Builds the three kernels' plans, which runs the backward once."""
        delta, acc = self._scratch(q, lse)
        self.pre = _KernelPlan(_preprocess_call(o, do, delta, acc))
        fused = _dkdv_call(c, is_causal, q, k, v, do, lse, delta, dk, dv, acc)
        self.fused = _KernelPlan(fused)
        # The Gluon pass scales its shares itself (see flash_bwd_one_pass_gluon_kernel).
        self.cast = _KernelPlan(_cast_call(acc, dq, fused.fn is flash_gluon.flash_bwd_one_pass_gluon_kernel))

    @property
    def plans(self) -> tuple[_KernelPlan, ...]:
        return self.pre, self.fused, self.cast

    @staticmethod
    def _scratch(q: torch.Tensor, lse: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """D, and the dQ accumulator (contiguous (batch, heads, seq, d) float32; the first kernel zeroes it)."""
        return torch.empty_like(lse), torch.empty(q.shape, dtype=torch.float32, device=q.device)

    def __call__(self, stream: int, q, k, v, o, do, lse, dq, dk, dv) -> None:
        delta, acc = self._scratch(q, lse)
        self.pre(stream, o, do, delta, acc)
        self.fused(stream, q, k, v, do, lse, delta, dk, dv, acc)
        self.cast(stream, acc, dq)


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): a view for 2-, 3- and 4-D tensors (strides kept as they are);
    more leading dims are folded into the batch axis."""
    if t.ndim == 4:
        return t
    if t.ndim == 3:
        return t.unsqueeze(1)
    if t.ndim == 2:
        return t[None, None]
    return t.reshape(-1, *t.shape[-3:])


def new_output(q: torch.Tensor) -> torch.Tensor:
    """O for a (batch, heads, n, d) Q, stored as (batch, n, heads, d): the model's
    ``out.transpose(1, 2).reshape(batch, n, heads * d)`` is then a view, not a copy. Other ranks: Q's shape,
    contiguous (one head: the same memory order)."""
    if q.ndim != 4:
        return q.new_empty(q.shape)
    batch, heads, n, d = q.shape
    return q.new_empty((batch, n, heads, d)).transpose(1, 2)


def _layout_key(*tensors: torch.Tensor) -> tuple:
    """Strides and the 16-byte alignment of each tensor: what a compiled kernel is specialized on besides
    shapes and dtypes."""
    return tuple((t.stride(), t.data_ptr() & 15) for t in tensors)


class AttentionPlan:
    """Everything about an attention call that its shapes, strides, dtypes, alignment, device and causality
    fix: the tuned configs and compiled kernels of the forward, and of the backward per (O, dO, L) layout.
    After the first call of a signature, a forward or backward is a few allocations and one or two
    launches, with no tuning lookup, argument building or input checks (the plan's key implies them).

    Tensors have any rank >= 2: (..., seq, d), as (batch, heads, seq, d) inside; outputs come back in the
    inputs' rank. ``launcher`` says who launches the kernels (see :data:`Launcher`): a "traced" plan tunes
    the block-pointer configs that a compiled graph launches itself, a "graphed" one the configs a CUDA
    graph replays, both under keys of their own and by device time (see _graph_time_ms)."""

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launcher: Launcher = "eager"
    ):
        q4, k4 = as_4d(q), as_4d(k)
        batch, heads, n_q, d = q4.shape
        self.case = (batch * heads, n_q, k4.shape[2], d, is_causal, q.dtype)
        self.is_causal = is_causal
        if launcher not in LAUNCHERS:
            raise ValueError(f"launcher must be one of {LAUNCHERS}, got {launcher!r}")
        self.launcher = launcher
        self.four_d = q.ndim == 4
        self.device = q.get_device()
        if q.is_cuda and self.device != torch.cuda.current_device():
            # Triton compiles and launches on the current device: device pointers of another would fault.
            raise ValueError(
                f"inputs are on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}: "
                f"call torch.cuda.set_device({self.device}) (or run inside `with torch.cuda.device({self.device})`)"
            )
        self.fwd: _KernelPlan | None = None
        self.bwd: dict[tuple, _SplitBackward | _OnePassBackward] = {}
        # (shape, strides) of O and of dQ, dK, dV (empty_like's dense layouts), allocated per call with
        # one empty_strided each instead of empty_like's or new_empty + transpose's two dispatches. Worked
        # out on meta tensors: no memory.
        qm, km, vm = (
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in (q, k, v)
        )
        self.layouts = tuple(
            (x.shape, x.stride()) for x in (new_output(qm), *map(torch.empty_like, (qm, km, vm)))
        )
        self.lse_shape, self.dtype, self.torch_device = q.shape[:-1], q.dtype, q.device

    def _stream(self) -> int:
        return 0 if INTERPRET else torch._C._cuda_getCurrentRawStream(self.device)

    def _tuned(
        self,
        kernel: str,
        tensors: tuple,
        calls: Callable[[TileConfig], list[_Call]],
        build: Callable[[TileConfig], Any] | None = None,
    ) -> Any:
        """The plan of ``kernel`` for these tensors: tuned (each candidate timed through a plan of its own,
        ``build(config)``, whose construction launches once, so the tuner sees the host cost that calls
        will pay), compiled, and launched once. ``calls(config)``: the launches a candidate's plan makes
        (compiled side by side before tuning); ``build`` defaults to the plan of the one launch."""
        if build is None:
            build = lambda c: _KernelPlan(calls(c)[0])
        if not INTERPRET and torch.cuda.is_current_stream_capturing():
            # Tuning times and synchronizes, and compiling loads modules: neither can be captured.
            raise RuntimeError(
                f"FlashAttention: the first {kernel!r} call of this signature (shapes {self.case[:4]}, causal="
                f"{self.is_causal}, {self.case[5]}) is being captured in a CUDA graph; it tunes and compiles, "
                "which a graph cannot record. Run one call with the same shapes and layouts before capture "
                "(as torch.compile's CUDA graphs do in their warm-up run)."
            )
        built: dict[TileConfig, Any] = {}

        def launch(c: TileConfig) -> None:
            if c in built:
                built[c](self._stream(), *tensors)
            else:
                built[c] = build(c)

        cfg = _pick(kernel, self.launcher, launch, *self.case, calls=calls)
        launch(cfg)  # the call's own launch (after tuning, whose launches wrote the same outputs)
        return built[cfg]

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """O (input dtype, layout of :func:`new_output`) and L (float32, contiguous, Q.shape[:-1])."""
        o = self._empty(0)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.torch_device)
        tensors = (q, k, v, o, lse) if self.four_d else (*map(as_4d, (q, k, v, o)), lse)
        if self.fwd is None:
            self.fwd = self._tuned("fwd", tensors, lambda c: [_fwd_call(c, self.is_causal, *tensors)])
        else:
            self.fwd(self._stream(), *tensors)
        return o, lse

    def backward(self, q, k, v, o, do, lse) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV (input dtype, the inputs' layouts), by the backward tuned for this (O, dO, L) layout:
        split (two launches) or one pass (three)."""
        grads = dq, dk, dv = self._empty(1), self._empty(2), self._empty(3)
        key = _layout_key(o, do, lse)
        if not self.four_d:
            q, k, v, o, do, dq, dk, dv = map(as_4d, (q, k, v, o, do, dq, dk, dv))
        tensors = (q, k, v, o, do, lse, dq, dk, dv)
        run = self.bwd.get(key)
        if run is None:
            self._check_lse(lse)
            self.bwd[key] = self._tuned_backward(tensors)
        else:
            run(self._stream(), *tensors)
        return grads

    def _tuned_backward(self, tensors: tuple) -> _SplitBackward | _OnePassBackward:
        """The dQ pass is tuned first (it writes D, which every dK/dV launch reads). Then the dK/dV
        candidates are timed as whole backwards: a split one runs the tuned dQ pass and its dK/dV pass, a
        one-pass one (``atomic_dq``) its three kernels."""
        q, k, v, o, do, lse, dq, dk, dv = tensors
        causal = self.is_causal
        delta = torch.empty_like(lse)
        dq_tensors = (q, k, v, o, do, lse, delta, dq)
        dq_plan = self._tuned("dq", dq_tensors, lambda c: [_dq_call(c, causal, *dq_tensors)])

        def dkdv_calls(c: TileConfig) -> list[_Call]:
            # One-pass candidates compile when built (their launches need the dQ accumulator).
            return [] if c.atomic_dq else [_dkdv_call(c, causal, q, k, v, do, lse, delta, dk, dv)]

        def build(c: TileConfig) -> _SplitBackward | _OnePassBackward:
            if c.atomic_dq:
                return _OnePassBackward(c, causal, *tensors)
            return _SplitBackward(dq_plan, _KernelPlan(dkdv_calls(c)[0]))

        return self._tuned("dkdv", tensors, dkdv_calls, build)

    def _empty(self, which: int) -> torch.Tensor:
        shape, stride = self.layouts[which]
        return torch.empty_strided(shape, stride, dtype=self.dtype, device=self.torch_device)

    @staticmethod
    def _check_lse(lse: torch.Tensor) -> None:
        if not lse.is_contiguous():
            raise ValueError(f"L must be contiguous, got strides {lse.stride()} for shape {tuple(lse.shape)}")


# Plans by call signature. Grows with the distinct shapes and layouts a process uses (a few per model);
# cleared with the tuning cache and whenever a config is forced.
_PLANS: dict[tuple, AttentionPlan] = {}


def attention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    *,
    launcher: Launcher = "eager",
    check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None = None,
) -> AttentionPlan:
    """The plan for this call's signature; ``check`` validates the inputs when a new plan is made (a known
    signature was valid when it was first seen, and its key holds everything the checks look at)."""
    try:
        key = (
            q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
            is_causal, launcher, torch.are_deterministic_algorithms_enabled(), *_layout_key(q, k, v),
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        if check is not None:
            check(q, k, v, is_causal)  # names what is wrong with the inputs
        raise
    plan = _PLANS.get(key)
    if plan is None:
        if check is not None:
            check(q, k, v, is_causal)
        plan = _PLANS[key] = AttentionPlan(q, k, v, is_causal, launcher)
    return plan


def _pick(
    kernel: str,
    launcher: Launcher,
    launch: Callable[[TileConfig], None],
    bh: int,
    n_q: int,
    n_k: int,
    d: int,
    is_causal: bool,
    dtype: torch.dtype,
    calls: Callable[[TileConfig], list[_Call]] | None = None,
) -> TileConfig:
    name, candidates = _tune_space(kernel, launcher, d, dtype)
    key = _tune_key(name, bh, n_q, n_k, d, is_causal, dtype)
    cfg = _choose(
        kernel, launch, key, candidates, calls, metric=TUNE_METRIC if launcher == "eager" else "graph"
    )
    traced = launcher == "traced"
    if cfg.tma and (traced or not TMA):  # a forced TMA config
        cfg = replace(cfg, tma=False)
    if cfg.atomic_dq and (traced or torch.are_deterministic_algorithms_enabled()):  # a forced one-pass one
        cfg = replace(cfg, atomic_dq=False)
    return cfg


def _tune_space(
    kernel: str, launcher: Launcher, d: int, dtype: torch.dtype
) -> tuple[str, tuple[TileConfig, ...]]:
    """The tuning-key name and the candidates of ``kernel``: block pointers only, under keys of their own,
    for a traced launch ("-traced", timed by another metric) or with ``CS336_FLASH_TMA=0`` ("-ptr"); with
    deterministic algorithms on, the dK/dV pass tunes among split backwards only ("-det"). A graphed
    launch tunes the eager candidates under keys of its own ("-graphed": another metric)."""
    if launcher == "traced":
        return f"{kernel}-traced", pointer_configs(kernel, d, dtype)
    suffix = "-graphed" if launcher == "graphed" else ""
    if not TMA:
        return f"{kernel}-ptr{suffix}", pointer_configs(kernel, d, dtype)
    candidates = candidate_configs(kernel, d, dtype)
    if kernel == "dkdv" and torch.are_deterministic_algorithms_enabled():
        return f"dkdv-det{suffix}", tuple(c for c in candidates if not c.atomic_dq)
    return f"{kernel}{suffix}", candidates


@functools.cache
def pointer_configs(kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates of ``kernel`` with block pointers only: what the inlined (traced) path tunes over,
    since a descriptor is built from the tensor's data pointer on the host. Split backwards only: the
    one-pass backward's atomic adds are bulk copies with descriptors, one atomic per element without."""
    listed = candidate_configs(kernel, d, dtype)
    return tuple(dict.fromkeys(replace(c, tma=False, gluon=False) for c in listed if not c.atomic_dq))


def flash_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launcher: Launcher = "eager"
):
    """O (input dtype, layout of :func:`new_output`) and L (float32, contiguous (batch, heads, n_q)) for
    4-D (batch, heads, seq, d) inputs of any strides."""
    return attention_plan(q, k, v, is_causal, launcher=launcher).forward(q, k, v)


def flash_backward(q, k, v, o, do, lse, is_causal: bool, launcher: Launcher = "eager"):
    """dQ, dK, dV (input dtype) for 4-D inputs of any strides, L contiguous (batch, heads, n_q)."""
    return attention_plan(q, k, v, is_causal, launcher=launcher).backward(q, k, v, o, do, lse)


# ----------------------------------------------------------------------------------------------------------
# The traced path: torch.library.triton_op bodies under torch.compile
# ----------------------------------------------------------------------------------------------------------


def _real_like(t: torch.Tensor) -> torch.Tensor:
    """A real tensor with ``t``'s shape, strides, dtype and device, filled with N(0, 1) values (the tuner
    times real launches; under tracing ``t`` is fake)."""
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device).normal_()


def tune_ahead(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool, launcher: Launcher
) -> None:
    """Tune the ``launcher``'s configs of all three kernels for this case on real tensors of the same
    layout, outside any tracing mode, while a graph is compiled: a traced launch bakes its config into the
    compiled graph, so the choice must exist when the graph is traced; a graphed one would otherwise tune
    in the CUDA graph's warm-up run, with the model's memory in use."""
    batch, heads, n_q, d = q.shape
    keys = [_tune_key(_tune_space(kernel, launcher, d, q.dtype)[0], batch * heads, n_q, k.shape[2], d,
                      is_causal, q.dtype) for kernel in ("fwd", "dq", "dkdv")]  # fmt: skip
    if all(key in _TUNE.cache for key in keys) or not AUTOTUNE or INTERPRET:
        return
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes(), torch.no_grad():
        qr, kr, vr = (_real_like(t) for t in (q, k, v))
        plan = AttentionPlan(qr, kr, vr, is_causal, launcher)
        o, lse = plan.forward(qr, kr, vr)
        plan.backward(qr, kr, vr, o, torch.randn_like(o), lse)


def _traced_config(kernel: str, q: torch.Tensor, k: torch.Tensor, is_causal: bool) -> TileConfig:
    """The block-pointer config :func:`tune_ahead` chose (or the default, with tuning off)."""

    def untuned(c: TileConfig) -> None:
        raise RuntimeError(f"{kernel}: traced configs are tuned by tune_ahead, before tracing launches")

    batch, heads, n_q, d = q.shape
    return _pick(kernel, "traced", untuned, batch * heads, n_q, k.shape[2], d, is_causal, q.dtype)


def flash_forward_traced(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """:func:`flash_forward` for a ``triton_op`` body: tuned block-pointer configs, ``wrap_triton``."""
    tune_ahead(q, k, v, is_causal, "traced")
    o = new_output(q)
    lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
    _fwd_call(_traced_config("fwd", q, k, is_causal), is_causal, q, k, v, o, lse).traced()
    return o, lse


def flash_backward_traced(q, k, v, o, do, lse, is_causal: bool):
    """:func:`flash_backward` for a ``triton_op`` body."""
    tune_ahead(q, k, v, is_causal, "traced")
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    delta = torch.empty_like(lse)
    _dq_call(_traced_config("dq", q, k, is_causal), is_causal, q, k, v, o, do, lse, delta, dq).traced()
    _dkdv_call(_traced_config("dkdv", q, k, is_causal), is_causal, q, k, v, do, lse, delta, dk, dv).traced()
    return dq, dk, dv
