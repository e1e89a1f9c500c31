"""The Gluon backward passes of FlashAttention-2 for Hopper, split as ``triton_bwd``'s (the dQ pass writes D
= rowsum(dO ∘ O), the dK/dV pass reads it):

- dQ: S_j, dP_j = dO V_j^T and dQ += dS_{j-1} K_{j-1} are issued together; P_j runs under dP_j, dS_j under
  the previous tile's dS K;
- dK/dV: S^T and dP^T are issued together; P^T runs under dP^T, dS^T under dV += P^T dO.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_common import (
    LOG2E,
    _head_origin,
    _key_ring_start,
    _load_key_tile,
    _o_offsets,
    _query_program,
    _register_operand,
    _row_sum,
    _store_rows,
    _wait_key_tile,
    _wgmma_layout,
)


# fmt: off
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
def _dq_first(q, do, k_tile, v_tile, zeros_s, lse2, delta, offs_q, q_start, qk_scale, BN: gl.constexpr,
              is_causal: gl.constexpr):
    """Key tile 0 of the dQ loop, alone (no dS K to overlap it with yet): dS_0, in Q's dtype."""
    s = warpgroup_mma(q, k_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))
    p = _probs_tile(s, lse2, offs_q, q_start, 0, qk_scale, BN, is_causal)
    dp = warpgroup_mma_wait(0, deps=(dp,))
    return (p * (dp - delta[:, None])).to(k_tile.dtype)


@gluon.jit
def _dq_step(q, do, k_tile, v_tile, k_prev, ds, dq, zeros_s, lse2, delta, offs_q, q_start, start_k, qk_scale,
             BN: gl.constexpr, is_causal: gl.constexpr):
    """One key tile of the dQ loop: S_j and dP_j are issued with the previous tile's dQ += dS K; P_j runs
    under dP_j and dS_j under that dS K. Returns dS_j (in Q's dtype) and dQ."""
    ds_layout: gl.constexpr = _register_operand(dq.type.layout)
    s = warpgroup_mma(q, k_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp = warpgroup_mma(do, v_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_prev, dq, is_async=True)
    s = warpgroup_mma_wait(2, deps=(s,))  # S_j is ready; dP_j and dS_{j-1} K_{j-1} run on
    p = _probs_tile(s, lse2, offs_q, q_start, start_k, qk_scale, BN, is_causal)
    dp = warpgroup_mma_wait(1, deps=(dp,))  # dP_j is ready; dS_{j-1} K_{j-1} runs on under dS_j
    ds = (p * (dp - delta[:, None])).to(k_tile.dtype)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    return ds, dq


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
    mbarrier.wait(bars.index(0), 0)
    ds = _dq_first(q, do_a, k_ring.index(0), v_ring.index(0), zeros_s, lse2, delta, offs_q, q_start, qk_scale, BN,
                   is_causal)
    for j in range(1, n_tiles):
        stage, prev = _wait_key_tile(bars, j, STAGES)
        start_k = j * BN
        ds, dq = _dq_step(q, do_a, k_ring.index(stage), v_ring.index(stage), k_ring.index(prev), ds, dq, zeros_s,
                          lse2, delta, offs_q, q_start, start_k, qk_scale, BN, is_causal)
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


@gluon.jit
def _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_org, do_org, stat_row, start, bar, q_ring, do_ring,
                     l_ring, delta_ring, stage, pred):
    """Q, dO, L and D of the query tile at ``start`` into ring stage ``stage``, by the copy engine (L and D
    too: their latency would otherwise sit in front of the exponentials). ``q_org``, ``do_org``: the head's
    (row, column) in Q's and dO's descriptors; ``stat_row``: its first row of L and D."""
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes + 2 * l_desc.block_type.nbytes
    mbarrier.expect(bar, nbytes, pred=pred)
    tma.async_copy_global_to_shared(q_desc, [q_org[0] + start, q_org[1]], bar, q_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(do_desc, [do_org[0] + start, do_org[1]], bar, do_ring.index(stage),
                                    pred=pred)
    tma.async_copy_global_to_shared(l_desc, [stat_row + start], bar, l_ring.index(stage), pred=pred)
    tma.async_copy_global_to_shared(delta_desc, [stat_row + start], bar, delta_ring.index(stage), pred=pred)


@gluon.jit
def _key_tile_start(k_desc, v_desc, bh, H, N_KEYS, k_start, SEQ_MAJOR: gl.constexpr, D: gl.constexpr):
    """A key-tile program's K and V tiles, copies in flight: their shared memory and barrier (``SEQ_MAJOR``:
    which of Q, K, V, dO are seq-major, bits 0-3; see ``_head_origin``)."""
    BN: gl.constexpr = k_desc.block_type.shape[0]
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [BN, D], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    k_row, k_col = _head_origin(bh, H, N_KEYS, SEQ_MAJOR & 2, D)
    v_row, v_col = _head_origin(bh, H, N_KEYS, SEQ_MAJOR & 4, D)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [k_row + k_start, k_col], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [v_row + k_start, v_col], kv_bar, v_smem)
    return k_smem, v_smem, kv_bar



@gluon.jit
def _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, MASKED: gl.constexpr):
    """P^T = exp2(S^T * scale * log2(e) - L * log2(e)), zero where a query precedes a key (causal)."""
    x = s_t * qk_scale - lse2[None, :]
    if MASKED:
        x = gl.where(offs_q[None, :] >= offs_k[:, None], x, float("-inf"))
    return gl.exp2(x)


@gluon.jit
def _key_program_start(q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, H, N_QUERIES, N_KEYS, BM: gl.constexpr,
                       BN: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr,
                       SEQ_MAJOR: gl.constexpr):
    """The start of a key-tile program (the dK/dV pass): its K and V tiles in shared memory, the ring of
    query tiles (Q, dO, L, D) with the first tile in flight, and the loop's bounds: the first query and the
    number of query tiles (causal: query tiles before k_start see none of these keys)."""
    dtype: gl.constexpr = q_desc.dtype
    bh = gl.program_id(1)
    k_start = gl.program_id(0) * BN
    k_smem, v_smem, kv_bar = _key_tile_start(k_desc, v_desc, bh, H, N_KEYS, k_start, SEQ_MAJOR, D)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], l_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(bars.index(i), count=1)
    if is_causal:  # noqa: SIM108
        lo = k_start
    else:
        lo = 0
    n_tiles = (N_QUERIES - lo) // BM
    q_org = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 1, D)
    do_org = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 8, D)
    _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_org, do_org, bh * N_QUERIES, lo, bars.index(0), q_ring,
                     do_ring, l_ring, delta_ring, 0, n_tiles > 0)
    mbarrier.wait(kv_bar, 0)
    mbarrier.invalidate(kv_bar)
    return bh, k_start, lo, n_tiles, q_org, do_org, k_smem, v_smem, q_ring, do_ring, l_ring, delta_ring, bars


@gluon.jit
def flash_bwd_dkdv_gluon_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr,
    H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    SEQ_MAJOR: gl.constexpr,
):
    """One program per key tile of BN keys (grid (N_KEYS / BN, batch * heads)); each warp group owns 64
    keys. Loops over query tiles of BM rows. The leading parameters line up with
    ``flash_bwd_dkdv_kernel``'s (one launch plan serves both); WARPS must equal the launch's num_warps;
    ``SEQ_MAJOR``: which of Q, K, V, dO, dK, dV are seq-major (bits 0-5, ``_head_origin``)."""
    STAGES: gl.constexpr = 2
    dtype: gl.constexpr = q_desc.dtype
    s_layout: gl.constexpr = _wgmma_layout(WARPS, BM)
    acc_layout: gl.constexpr = _wgmma_layout(WARPS, D)
    a_layout: gl.constexpr = _register_operand(acc_layout)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_vec: gl.constexpr = gl.SliceLayout(1, s_layout)

    bh, k_start, lo, n_tiles, q_org, do_org, k_smem, v_smem, q_ring, do_ring, l_ring, delta_ring, bars = (
        _key_program_start(q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, H, N_QUERIES, N_KEYS, BM, BN, D,
                           is_causal, STAGES, SEQ_MAJOR))
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
        _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_org, do_org, bh * N_QUERIES, start_q + BM,
                         bars.index(nxt), q_ring, do_ring, l_ring, delta_ring, nxt, i + 1 < n_tiles)
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
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(bars.index(i))
    _store_rows(dV_ptr, dv, bh, H, N_KEYS, k_start, SEQ_MAJOR & 32, D)
    _store_rows(dK_ptr, dk * scale, bh, H, N_KEYS, k_start, SEQ_MAJOR & 16, D)
# fmt: on
