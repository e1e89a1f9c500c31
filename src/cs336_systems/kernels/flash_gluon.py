"""FlashAttention-2 in Gluon for Hopper: the forward, the dQ pass and the dK/dV pass, with the same math as
their Triton twins in ``flash_attention`` (split backward: the dQ pass writes D = rowsum(dO ∘ O), the dK/dV
pass reads it), but with the matmuls issued asynchronously by hand.

Why Gluon: Triton 3.6 waits for every matmul whose result is not a loop-carried accumulator right after
issuing it, so the tensor cores idle while the exponentials and the elementwise products are computed.
Here each loop keeps a matmul running under them (FA3's intra-warpgroup overlap, without its producer
warps):

- forward: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued together; the softmax of S_j runs while the
  previous tile's P V does;
- dQ: S_j, dP_j = dO V_j^T and dQ += dS_{j-1} K_{j-1} are issued together; P_j runs under dP_j, dS_j under
  the previous tile's dS K;
- dK/dV: S^T and dP^T are issued together; P^T runs under dP^T, dS^T under dV += P^T dO;
- the one-pass backward (dK/dV and dQ's shares): S and dP query-major, P and dS through shared memory, and
  each tile's dS K added into a float32 dQ accumulator by the copy engine (``cp.reduce.async.bulk.tensor``)
  under the next tile's matmuls.

No accumulator is left in flight across a loop's back edge: ptxas then serializes every wgmma of the kernel
(C7514). K/V (forward, dQ) or Q/dO (dK/dV) tiles stream through a TMA ring with mbarriers.

Constraints (checked by :func:`gluon_supported`): Hopper, bf16/fp16, head dim 64 or 128, contiguous (batch,
heads, seq, d) tensors whose lengths are multiples of the tiles, so that 2-D descriptors over (batch *
heads * seq, d) rows never cross a head.
"""

from __future__ import annotations

import math

import torch
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


@builtin
def _reduce_add_async(tensor_desc, coord, src, _semantic=None):
    """Add a shared-memory tile into global memory at ``coord`` by the copy engine
    (cp.reduce.async.bulk.tensor); wait with ``tma.store_wait`` before overwriting ``src``. Gluon 3.6 exposes
    the op only on its builder (Triton's ``desc.atomic_add`` lowers to it)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


# fmt: off
@gluon.constexpr_function
def _wgmma_layout(warps, n):
    """The register layout of a wgmma result with N = ``n`` columns, ``warps`` warps along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])


@gluon.constexpr_function
def _split_n_layout(warps, n):
    """A wgmma result of 64 rows shared by ``warps`` // 4 warp groups side by side, each ``n`` / groups
    columns wide."""
    groups = warps // 4
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, groups], instr_shape=[16, n // groups, 16])


@gluon.constexpr_function
def _register_operand(parent):
    """The layout of a wgmma's A operand held in registers, for a result in ``parent``."""
    return gl.DotOperandLayout(operand_index=0, parent=parent, k_width=2)


@gluon.jit
def _max(a, b):
    return gl.maximum(a, b)


@gluon.jit
def _add(a, b):
    return a + b


# Row reductions through gl.reduce with Gluon combines: gl.max and gl.sum are Triton-language functions,
# which TRITON_INTERPRET=1 (the CPU test runs) turns into interpreter objects that Gluon cannot compile.
@gluon.jit
def _row_max(x):
    return gl.reduce(x, 1, _max)


@gluon.jit
def _row_sum(x):
    return gl.reduce(x, 1, _add)


@gluon.jit
def _load_key_tile(k_desc, v_desc, row, bar, k_ring, v_ring, stage, pred):
    """K and V of one key tile into ring stage ``stage``."""
    mbarrier.expect(bar, 2 * k_desc.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(k_desc, [row, 0], bar, k_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(v_desc, [row, 0], bar, v_ring.index(stage), pred=pred)


@gluon.jit
def _key_ring_start(k_desc, v_desc, k_row0, n_tiles, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """The K/V ring of a query-tile program (forward, dQ), its STAGES barriers and the first STAGES tiles
    in flight."""
    dtype: gl.constexpr = k_desc.dtype
    k_ring = gl.allocate_shared_memory(dtype, [STAGES, BN, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(dtype, [STAGES, BN, D], v_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
        _load_key_tile(k_desc, v_desc, k_row0 + i * BN, bars.index(i), k_ring, v_ring, i, i < n_tiles)
    return k_ring, v_ring, bars


@gluon.jit
def _wait_key_tile(bars, j, STAGES: gl.constexpr):
    """Wait until key tile ``j`` is in the ring; its slot, and the previous tile's."""
    mbarrier.wait(bars.index(j % STAGES), (j // STAGES) & 1)
    return j % STAGES, (j - 1) % STAGES


@gluon.jit
def _query_program(N_QUERIES, N_KEYS, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr):
    """This program's (batch * head, first query, key tiles): heaviest causal tiles first, as the Triton
    kernels' ``_query_tile``; a causal query tile sees keys up to its last query."""
    if is_causal:
        q_start = (gl.num_programs(0) - 1 - gl.program_id(0)) * BM
        n_tiles = (gl.minimum(q_start + BM, N_KEYS) + BN - 1) // BN
    else:
        q_start = gl.program_id(0) * BM
        n_tiles = N_KEYS // BN
    return gl.program_id(1), q_start, n_tiles


@gluon.jit
def _o_offsets(bh, q_start, stride_ob, stride_oh, stride_on, H, BM: gl.constexpr, D: gl.constexpr, layout):
    """Offsets of a [BM, D] tile of O in ``layout``: O is strided (the plan stores it as (batch, seq, heads,
    d), so that the model's merge of heads is a view), only its d axis is contiguous."""
    rows = q_start + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    base = (bh // H).to(gl.int64) * stride_ob + (bh % H).to(gl.int64) * stride_oh
    return base + rows.to(gl.int64)[:, None] * stride_on + cols[None, :]


@gluon.jit
def _online_softmax(s, m_i, l_i, offs_q, start_k, qk_scale, BN: gl.constexpr, MASKED: gl.constexpr):
    """One key tile of the online softmax in log2 units: P, and the running max and sum with the factor
    (alpha) that rescales what was accumulated under the old max."""
    if MASKED:
        offs_k = start_k + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        x = gl.where(offs_k[None, :] > offs_q[:, None], float("-inf"), s * qk_scale)
        m_new = gl.maximum(m_i, _row_max(x))
        p = gl.exp2(x - m_new[:, None])
    else:
        m_new = gl.maximum(m_i, _row_max(s) * qk_scale)
        p = gl.exp2(s * qk_scale - m_new[:, None])  # the scale folded into the exponent's FMA
    alpha = gl.exp2(m_i - m_new)
    return p, m_new, l_i * alpha + _row_sum(p), alpha


@gluon.jit
def _softmax_tile(s, m_i, l_i, offs_q, q_start, start_k, qk_scale, BN: gl.constexpr, is_causal: gl.constexpr):
    """:func:`_online_softmax` of key tile ``start_k``, masked only where a key can follow a query."""
    if is_causal:
        if start_k + BN > q_start:
            p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, offs_q, start_k, qk_scale, BN, True)
        else:
            p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, offs_q, start_k, qk_scale, BN, False)
    else:
        p, m_i, l_i, alpha = _online_softmax(s, m_i, l_i, offs_q, start_k, qk_scale, BN, False)
    return p, m_i, l_i, alpha


@gluon.jit
def flash_fwd_gluon_kernel(
    q_desc, k_desc, v_desc, O_ptr, L_ptr,
    stride_ob, stride_oh, stride_on, H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One program per query tile of BM rows (grid (N_QUERIES / BM, batch * heads)); each warp group owns
    64 rows. The leading parameters line up with ``flash_fwd_kernel``'s (one launch plan serves both);
    WARPS must equal the launch's num_warps. Key tile j is issued with the previous tile's P V, and its
    softmax runs under that P V; the ring slot of tile j - 1 is refilled once both are done."""
    dtype: gl.constexpr = q_desc.dtype
    bh, q_start, n_tiles = _query_program(N_QUERIES, N_KEYS, BM, BN, is_causal)
    k_row0 = bh * N_KEYS

    s_layout: gl.constexpr = _wgmma_layout(WARPS, BN)
    o_layout: gl.constexpr = _wgmma_layout(WARPS, D)
    p_layout: gl.constexpr = _register_operand(o_layout)
    q_layout: gl.constexpr = _register_operand(s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [bh * N_QUERIES + q_start, 0], q_bar, q_smem)
    k_ring, v_ring, bars = _key_ring_start(k_desc, v_desc, k_row0, n_tiles, BN, D, STAGES)

    qk_scale = scale * LOG2E
    offs_q = q_start + gl.arange(0, BM, layout=rows_s)
    zeros_s = gl.zeros([BM, BN], gl.float32, s_layout)
    m_i = gl.full([BM], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([BM], gl.float32, rows_s)
    acc = gl.zeros([BM, D], gl.float32, o_layout)

    # Tile 0 alone: nothing to overlap it with yet.
    mbarrier.wait(q_bar, 0)
    # Q as the register operand of every S = Q K^T: with both operands in shared memory, a 64-key tile's
    # matmul reads as many bytes per flop as shared memory delivers, and the tensor cores would wait on it.
    q = q_smem.load(q_layout)
    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q, k_ring.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_q, q_start, 0, qk_scale, BN, is_causal)
    for j in range(1, n_tiles):
        stage, prev = _wait_key_tile(bars, j, STAGES)
        start_k = j * BN
        s = warpgroup_mma(q, k_ring.index(stage).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_ring.index(prev), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s,))  # S_j is ready; P_{j-1} V_{j-1} runs on under the softmax
        p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_q, q_start, start_k, qk_scale, BN, is_causal)
        acc = warpgroup_mma_wait(0, deps=(acc,))
        # Tile j - 1's K and V are read: refill its slot with tile j - 1 + STAGES.
        nxt = j - 1 + STAGES
        _load_key_tile(k_desc, v_desc, k_row0 + nxt * BN, bars.index(prev), k_ring, v_ring, prev,
                       nxt < n_tiles)
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_ring.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))

    acc = acc / gl.convert_layout(l_i, rows_o)[:, None]
    o_offs = _o_offsets(bh, q_start, stride_ob, stride_oh, stride_on, H, BM, D, o_layout)
    gl.store(O_ptr + o_offs, acc.to(dtype))
    # Natural-log units: L is the contract's logsumexp.
    gl.store(L_ptr + bh.to(gl.int64) * N_QUERIES + offs_q, (m_i + gl.log2(l_i)) * LN2)


@gluon.jit
def _probs(s, lse2, offs_q, start_k, qk_scale, BN: gl.constexpr, MASKED: gl.constexpr):
    """P = exp2(S * scale * log2(e) - L * log2(e)), zero where a key follows the query (causal)."""
    x = s * qk_scale - lse2[:, None]
    if MASKED:
        offs_k = start_k + gl.arange(0, BN, layout=gl.SliceLayout(0, s.type.layout))
        x = gl.where(offs_k[None, :] > offs_q[:, None], float("-inf"), x)
    return gl.exp2(x)


@gluon.jit
def _probs_tile(s, lse2, offs_q, q_start, start_k, qk_scale, BN: gl.constexpr, is_causal: gl.constexpr):
    """:func:`_probs` of key tile ``start_k``, masked only where a key can follow a query."""
    if is_causal:
        if start_k + BN > q_start:
            p = _probs(s, lse2, offs_q, start_k, qk_scale, BN, True)
        else:
            p = _probs(s, lse2, offs_q, start_k, qk_scale, BN, False)
    else:
        p = _probs(s, lse2, offs_q, start_k, qk_scale, BN, False)
    return p


@gluon.jit
def flash_bwd_dq_gluon_kernel(
    q_desc, k_desc, v_desc, O_ptr, do_desc, L_ptr, Delta_ptr, dQ_ptr,
    stride_ob, stride_oh, stride_on, H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr,
):
    """The first backward pass, one program per query tile (grid (N_QUERIES / BM, batch * heads)): D =
    rowsum(dO ∘ O) for its rows (stored for the dK/dV pass), then dQ over key tiles. The leading parameters
    line up with ``flash_bwd_dq_kernel``'s. S_j and dP_j are issued with the previous tile's dQ += dS K:
    P_j runs under dP_j and dS_j under that dS K."""
    dtype: gl.constexpr = q_desc.dtype
    bh, q_start, n_tiles = _query_program(N_QUERIES, N_KEYS, BM, BN, is_causal)
    k_row0 = bh * N_KEYS
    q_row = bh * N_QUERIES + q_start

    s_layout: gl.constexpr = _wgmma_layout(WARPS, BN)
    acc_layout: gl.constexpr = _wgmma_layout(WARPS, D)
    ds_layout: gl.constexpr = _register_operand(acc_layout)
    a_layout: gl.constexpr = _register_operand(s_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)

    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BM, D], do_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, 0], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [q_row, 0], q_bar, do_smem)
    k_ring, v_ring, bars = _key_ring_start(k_desc, v_desc, k_row0, n_tiles, BN, D, STAGES)

    # D = rowsum(dO ∘ O) while the first tiles load: O by pointer (read once), dO from its tile.
    offs_q = q_start + gl.arange(0, BM, layout=rows_s)
    o = gl.load(O_ptr + _o_offsets(bh, q_start, stride_ob, stride_oh, stride_on, H, BM, D, acc_layout))
    o = o.to(gl.float32)
    mbarrier.wait(q_bar, 0)
    # Q and dO as the register operands of S = Q K^T and dP = dO V^T (see the forward's Q).
    q = q_smem.load(a_layout)
    do_a = do_smem.load(a_layout)
    do = do_smem.load(acc_layout).to(gl.float32)
    delta = gl.convert_layout(_row_sum(o * do), rows_s)
    gl.store(Delta_ptr + bh.to(gl.int64) * N_QUERIES + offs_q, delta)
    lse2 = gl.load(L_ptr + bh.to(gl.int64) * N_QUERIES + offs_q) * LOG2E

    qk_scale = scale * LOG2E
    zeros_s = gl.zeros([BM, BN], gl.float32, s_layout)
    dq = gl.zeros([BM, D], gl.float32, acc_layout)
    # Tile 0 alone: no dS K to overlap it with yet.
    mbarrier.wait(bars.index(0), 0)
    s = warpgroup_mma(q, k_ring.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do_a, v_ring.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    p = _probs_tile(s, lse2, offs_q, q_start, 0, qk_scale, BN, is_causal)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    ds = (p * (dp - delta[:, None])).to(dtype)
    for j in range(1, n_tiles):
        stage, prev = _wait_key_tile(bars, j, STAGES)
        start_k = j * BN
        s = warpgroup_mma(q, k_ring.index(stage).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_a, v_ring.index(stage).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_ring.index(prev), dq, is_async=True)
        s = warpgroup_mma_wait(2, deps=(s,))  # S_j is ready; dP_j and dS_{j-1} K_{j-1} run on
        p = _probs_tile(s, lse2, offs_q, q_start, start_k, qk_scale, BN, is_causal)
        dp = warpgroup_mma_wait(1, deps=(dp,))  # dP_j is ready; dS_{j-1} K_{j-1} runs on under dS_j
        ds = (p * (dp - delta[:, None])).to(dtype)
        dq = warpgroup_mma_wait(0, deps=(dq,))
        # Tile j - 1's K and V are read: refill its slot with tile j - 1 + STAGES.
        nxt = j - 1 + STAGES
        _load_key_tile(k_desc, v_desc, k_row0 + nxt * BN, bars.index(prev), k_ring, v_ring, prev,
                       nxt < n_tiles)
    last = (n_tiles - 1) % STAGES
    dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_ring.index(last), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    rows = q_row.to(gl.int64) + gl.arange(0, BM, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    gl.store(dQ_ptr + rows[:, None] * D + cols[None, :], (dq * scale).to(dtype))
# fmt: on


# fmt: off
@gluon.jit
def _load_query_tile(q_desc, do_desc, l_desc, delta_desc, row, bar, q_ring, do_ring, l_ring, delta_ring, stage,
                     pred):
    """Q, dO, L and D of one query tile into ring stage ``stage``, by the copy engine (L and D too: their
    latency would otherwise sit in front of the exponentials)."""
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [row, 0], bar, q_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [row, 0], bar, do_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(l_desc, [row], bar, l_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(delta_desc, [row], bar, delta_ring.index(stage), pred=pred)


@gluon.jit
def _add_dq_tile(dq_acc_desc, dq_smem, dq, row):
    """Add a float32 dQ tile to the accumulator's rows [row, row + BM) by the copy engine, through
    ``dq_smem`` once the previous tile's reduction has read it."""
    tma.store_wait(0)
    dq_smem.store(dq)
    fence_async_shared()
    _reduce_add_async(dq_acc_desc, [row, 0], dq_smem)


@gluon.jit
def _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, MASKED: gl.constexpr):
    """P^T = exp2(S^T * scale * log2(e) - L * log2(e)), zero where a query precedes a key (causal)."""
    x = s_t * qk_scale - lse2[None, :]
    if MASKED:
        x = gl.where(offs_q[None, :] >= offs_k[:, None], x, float("-inf"))
    return gl.exp2(x)


@gluon.jit
def _key_program_start(q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, N_QUERIES, N_KEYS, BM: gl.constexpr,
                       BN: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr):
    """The start of a key-tile program (the dK/dV passes): its K and V tiles in shared memory, the ring of
    query tiles (Q, dO, L, D) with the first tile in flight, and the loop's bounds: the first query and the
    number of query tiles (causal: query tiles before k_start see none of these keys)."""
    dtype: gl.constexpr = q_desc.dtype
    bh = gl.program_id(1)
    k_start = gl.program_id(0) * BN
    k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], l_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES + 1):
        mbarrier.init(bars.index(i), count=1)
    if is_causal:  # noqa: SIM108
        lo = k_start
    else:
        lo = 0
    n_tiles = (N_QUERIES - lo) // BM

    kv_bar = bars.index(STAGES)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bh * N_KEYS + k_start, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [bh * N_KEYS + k_start, 0], kv_bar, v_smem)
    _load_query_tile(q_desc, do_desc, l_desc, delta_desc, bh * N_QUERIES + lo, bars.index(0), q_ring, do_ring,
                     l_ring, delta_ring, 0, n_tiles > 0)
    mbarrier.wait(kv_bar, 0)
    return bh, k_start, lo, n_tiles, k_smem, v_smem, q_ring, do_ring, l_ring, delta_ring, bars


@gluon.jit
def _store_dk_dv(dK_ptr, dV_ptr, dk, dv, bh, k_start, N_KEYS, scale, BN: gl.constexpr, D: gl.constexpr):
    """dK (times the softmax scale) and dV of a key tile. (32-bit offsets within the tile made ptxas spill
    in the split pass at d = 128 with two warp groups.)"""
    layout: gl.constexpr = dk.type.layout
    rows = k_start + gl.arange(0, BN, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    offs = (bh.to(gl.int64) * N_KEYS + rows[:, None]) * D + cols[None, :]
    gl.store(dK_ptr + offs, (dk * scale).to(dK_ptr.dtype.element_ty))
    gl.store(dV_ptr + offs, dv.to(dV_ptr.dtype.element_ty))


@gluon.jit
def flash_bwd_dkdv_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr, dQ_unused,
    N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
):
    """One program per key tile of BN keys (grid (N_KEYS / BN, batch * heads)); each warp group owns 64
    keys. Loops over query tiles of BM rows. The leading parameters line up with the Triton dK/dV kernel's
    (``dQ_unused`` is its dQ accumulator, which the split backward never reads), so that one launch plan
    serves both; WARPS must equal the launch's num_warps."""
    STAGES: gl.constexpr = 2
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(WARPS, BM)
    acc_layout: gl.constexpr = _wgmma_layout(WARPS, D)
    a_layout: gl.constexpr = _register_operand(acc_layout)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_vec: gl.constexpr = gl.SliceLayout(1, s_layout)

    bh, k_start, lo, n_tiles, k_smem, v_smem, q_ring, do_ring, l_ring, delta_ring, bars = _key_program_start(
        q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, N_QUERIES, N_KEYS, BM, BN, D, is_causal, STAGES)
    q_row0 = bh * N_QUERIES
    diag_end = k_start + BN  # query tiles in [k_start, diag_end) straddle the diagonal (causal)

    qk_scale = scale * LOG2E
    offs_k = k_start + gl.arange(0, BN, layout=k_vec)
    dk = gl.zeros([BN, D], gl.float32, acc_layout)
    dv = gl.zeros([BN, D], gl.float32, acc_layout)
    zeros_s = gl.zeros([BN, BM], gl.float32, s_layout)
    for i in range(n_tiles):
        stage = i % STAGES
        start_q = lo + i * BM
        q_buf = q_ring.index(stage)
        do_buf = do_ring.index(stage)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        s_t = warpgroup_mma(k_smem, q_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_smem, do_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        # The other stage's readers (the previous tile's matmuls) are done: prefetch the next tile into it.
        nxt = (i + 1) % STAGES
        _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_row0 + start_q + BM, bars.index(nxt), q_ring,
                         do_ring, l_ring, delta_ring, nxt, i + 1 < n_tiles)
        offs_q = start_q + gl.arange(0, BM, layout=q_vec)
        lse2 = l_ring.index(stage).load(q_vec) * LOG2E
        delta = delta_ring.index(stage).load(q_vec)
        s_t = warpgroup_mma_wait(1, deps=(s_t,))  # S^T is ready; dP^T runs on under the exponentials
        if is_causal:
            if start_q < diag_end:
                p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, True)
            else:
                p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
        else:
            p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_buf, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))  # dP^T is ready; dV += P^T dO runs on under dS^T
        ds_t = p_t * (dp_t - delta[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_buf, dk, is_async=True)
        # Waiting here, not at the next tile's first wait: an accumulator in flight across the loop's back
        # edge makes ptxas serialize every wgmma of the kernel (C7514).
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
    for i in gl.static_range(STAGES + 1):
        mbarrier.invalidate(bars.index(i))
    _store_dk_dv(dK_ptr, dV_ptr, dk, dv, bh, k_start, N_KEYS, scale, BN, D)


@gluon.jit
def flash_bwd_one_pass_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr, dq_acc_desc,
    N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
):
    """The one-pass backward in FA3's orientation: one program per key tile of BN keys, 64 per warp group,
    looping over query tiles of BM = 64 rows (grid (N_KEYS / BN, batch * heads)). The parameters are the
    split dK/dV pass's, with the float32 dQ accumulator's descriptor in its dQ slot.

    S = Q K^T and dP = dO V^T are computed query-major, each warp group the columns of its own keys, so L
    and D are two registers per thread (the transposed orientation of ``flash_bwd_dkdv_gluon_kernel`` holds
    a column of them each, and spills at d = 128 with dQ's share beside dK and dV). P and dS go through
    shared memory: P^T and dS^T are the A operands of dV += P^T dO and dK += dS^T Q, and dS, all BN keys of
    it, of dQ = dS K, whose columns the warp groups split. Each tile's dQ share, times the scale, is added
    into the zeroed float32 accumulator behind ``dq_acc_desc`` by the copy engine, which has the next
    tile's matmuls to finish it: five matmuls per tile pair instead of the split backward's seven."""
    STAGES: gl.constexpr = 2
    dtype: gl.constexpr = q_desc.dtype
    gl.static_assert(BM == 64 and BN == 16 * WARPS, "one-pass tiles: 64 queries, 64 keys per warp group")
    s_layout: gl.constexpr = _split_n_layout(WARPS, BN)  # [BM, BN]; warp group g: keys [64 g, 64 g + 64)
    acc_layout: gl.constexpr = _wgmma_layout(WARPS, D)  # [BN, D]; warp group g: the same keys' rows
    dq_layout: gl.constexpr = _split_n_layout(WARPS, D)
    q_vec: gl.constexpr = gl.SliceLayout(1, s_layout)

    p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dtype)
    p_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_layout)
    ds_smem = gl.allocate_shared_memory(dtype, [BM, BN], p_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [BM, D], dq_acc_desc.layout)
    bh, k_start, lo, n_tiles, k_smem, v_smem, q_ring, do_ring, l_ring, delta_ring, bars = _key_program_start(
        q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, N_QUERIES, N_KEYS, BM, BN, D, is_causal, STAGES)
    q_row0 = bh * N_QUERIES
    diag_end = k_start + BN

    qk_scale = scale * LOG2E
    dk = gl.zeros([BN, D], gl.float32, acc_layout)
    dv = gl.zeros([BN, D], gl.float32, acc_layout)
    zeros_s = gl.zeros([BM, BN], gl.float32, s_layout)
    zeros_dq = gl.zeros([BM, D], gl.float32, dq_layout)
    for i in range(n_tiles):
        stage = i % STAGES
        start_q = lo + i * BM
        q_buf = q_ring.index(stage)
        do_buf = do_ring.index(stage)
        mbarrier.wait(bars.index(stage), (i // STAGES) & 1)
        s = warpgroup_mma(q_buf, k_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dp = warpgroup_mma(do_buf, v_smem.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        nxt = (i + 1) % STAGES  # its readers, the previous tile's matmuls, are done: prefetch into it
        _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_row0 + start_q + BM, bars.index(nxt), q_ring,
                         do_ring, l_ring, delta_ring, nxt, i + 1 < n_tiles)
        offs_q = start_q + gl.arange(0, BM, layout=q_vec)
        lse2 = l_ring.index(stage).load(q_vec) * LOG2E
        delta = delta_ring.index(stage).load(q_vec)
        s = warpgroup_mma_wait(1, deps=(s,))  # S is ready; dP runs on under the exponentials
        if is_causal:
            if start_q < diag_end:
                p = _probs(s, lse2, offs_q, k_start, qk_scale, BN, True)
            else:
                p = _probs(s, lse2, offs_q, k_start, qk_scale, BN, False)
        else:
            p = _probs(s, lse2, offs_q, k_start, qk_scale, BN, False)
        p_smem.store(p.to(dtype))  # its reader, the previous tile's dV matmul, was waited at that tile's end
        fence_async_shared()
        dv = warpgroup_mma(p_smem.permute((1, 0)), do_buf, dv, is_async=True)
        dp = warpgroup_mma_wait(1, deps=(dp,))  # dP is ready; dV += P^T dO runs on under dS
        ds_smem.store((p * (dp - delta[:, None])).to(dtype))
        fence_async_shared()
        # dQ before dK, so that dK's matmul runs under dQ's trip to shared memory.
        dq = warpgroup_mma(ds_smem, k_smem, zeros_dq, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q_buf, dk, is_async=True)
        dv, dq = warpgroup_mma_wait(1, deps=(dv, dq))
        _add_dq_tile(dq_acc_desc, dq_smem, dq * scale, q_row0 + start_q)
        # Not left in flight across the back edge: ptxas would serialize every wgmma of the kernel (C7514).
        dk = warpgroup_mma_wait(0, deps=(dk,))
    for i in gl.static_range(STAGES + 1):
        mbarrier.invalidate(bars.index(i))
    tma.store_wait(0)  # dq_smem must outlive the last reduction's read
    _store_dk_dv(dK_ptr, dV_ptr, dk, dv, bh, k_start, N_KEYS, scale, BN, D)
# fmt: on


SUPPORTED_D = (64, 128)


def gluon_supported(
    kernel: str,
    q_tile: int,
    k_tile: int,
    q,
    k,
    *others: torch.Tensor,
    stats: tuple[torch.Tensor, ...] = (),
    o: torch.Tensor | None = None,
) -> bool:
    """Whether a Gluon pass can run this call of ``kernel`` ("fwd", "dq", "dkdv"; otherwise the caller runs
    the Triton kernel with the same tiles): a Hopper GPU (wgmma), 2-byte floats, d of 64 or 128, contiguous
    (batch, heads, seq, d) tensors of Q's dtype (``others``: the call's other ones; ``stats``: L and D,
    contiguous float32; ``o``, read or written by pointer, needs only a contiguous d axis) whose sequence
    lengths are multiples of the tiles (2-D descriptors over all rows then never cross a head), and for
    dK/dV, diagonal tiles that line up with the query steps."""
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16):
        return False
    if any(t.dtype != q.dtype or not t.is_contiguous() for t in (q, k, *others)):
        return False
    if any(t.dtype != torch.float32 or not t.is_contiguous() for t in stats):
        return False
    if o is not None and (o.dtype != q.dtype or o.stride(-1) != 1):
        return False
    if q.shape[-1] not in SUPPORTED_D or q.shape[2] % q_tile or k.shape[2] % k_tile:
        return False
    return kernel != "dkdv" or k_tile % q_tile == 0


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def _descriptor(flat: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """A descriptor of ``box``-shaped tiles over ``flat``, with the default swizzle for them."""
    layout = gl.NVMMASharedLayout.get_default_for(box, _gl_dtype(flat.dtype))
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, layout)


def _rows(t: torch.Tensor, tile: int) -> TensorDescriptor:
    """[tile, d] boxes over the rows of a contiguous (batch, heads, seq, d) tensor."""
    return _descriptor(t.view(-1, t.shape[-1]), [tile, t.shape[-1]])


def _tail(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """Every kernel's trailing arguments: N_QUERIES, N_KEYS and the softmax scale."""
    return q.shape[2], k.shape[2], 1.0 / math.sqrt(q.shape[3])


def _o_strides(o: torch.Tensor) -> tuple:
    """O's batch, head and row strides, then the number of heads."""
    return o.stride(0), o.stride(1), o.stride(2), o.shape[1]


def fwd_gluon_args(q_tile: int, k_tile: int, q, k, v, o, lse) -> tuple:
    """The forward's arguments: Q, K, V descriptors, then O, L and the trailing integers and scale."""
    return (_rows(q, q_tile), _rows(k, k_tile), _rows(v, k_tile), o, lse, *_o_strides(o), *_tail(q, k))


def dq_gluon_args(q_tile: int, k_tile: int, q, k, v, o, do, lse, delta, dq) -> tuple:
    """The dQ pass's arguments: Q, K, V descriptors, O, the dO descriptor, then L, D, dQ and the tail."""
    return (_rows(q, q_tile), _rows(k, k_tile), _rows(v, k_tile), o, _rows(do, q_tile), lse, delta, dq,
            *_o_strides(o), *_tail(q, k))  # fmt: skip


def one_pass_tiles(q_tile: int, k_tile: int, num_warps: int) -> bool:
    """Whether ``flash_bwd_one_pass_gluon_kernel`` takes these tiles: 64 queries, 64 keys per warp group."""
    return q_tile == 64 and num_warps in (4, 8) and k_tile == 16 * num_warps


def dkdv_gluon_args(q_tile: int, k_tile: int, q, k, v, do, lse, delta, dk, dv, dq_acc=None) -> tuple:
    """The dK/dV pass's arguments: descriptors of [tile, d] boxes over the tensors' rows and of [q_tile]
    boxes over L and D, then dK, dV, the dQ slot (the one-pass backward's float32 accumulator, as [q_tile,
    d] boxes; else dK, unread) and the tail."""
    vector = lambda t: _descriptor(t.view(-1), [q_tile])
    descs = (
        _rows(q, q_tile),
        _rows(k, k_tile),
        _rows(v, k_tile),
        _rows(do, q_tile),
        vector(lse),
        vector(delta),
    )
    return (*descs, dk, dv, dk if dq_acc is None else _rows(dq_acc, q_tile), *_tail(q, k))
