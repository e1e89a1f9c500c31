"""The Gluon forward of FlashAttention-2 for Hopper: S_j = Q K_j^T and O += P_{j-1} V_{j-1} are issued
together, and the softmax of S_j runs while the previous tile's P V does. Same math as ``triton_fwd``."""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_common import (
    LN2,
    LOG2E,
    _key_ring_start,
    _load_key_tile,
    _o_offsets,
    _query_program,
    _register_operand,
    _row_max,
    _row_sum,
    _wait_key_tile,
    _wgmma_layout,
)


# fmt: off
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
def _fwd_step(q, k_tile, v_prev, p, acc, m_i, l_i, zeros_s, offs_q, q_start, start_k, qk_scale, BN: gl.constexpr,
              is_causal: gl.constexpr):
    """One key tile of the loop: S_j = Q K_j^T is issued with the previous tile's O += P V, and the softmax
    of S_j runs under that P V. Returns P_j, the running max and sum, the factor that rescales O (not yet
    applied) and O."""
    p_layout: gl.constexpr = _register_operand(acc.type.layout)
    s = warpgroup_mma(q, k_tile.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    acc = warpgroup_mma(gl.convert_layout(p.to(k_tile.dtype), p_layout), v_prev, acc, is_async=True)
    s = warpgroup_mma_wait(1, deps=(s,))  # S_j is ready; P_{j-1} V_{j-1} runs on under the softmax
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_q, q_start, start_k, qk_scale, BN, is_causal)
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return p, m_i, l_i, alpha, acc


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
        p, m_i, l_i, alpha, acc = _fwd_step(q, k_ring.index(stage), v_ring.index(prev), p, acc, m_i, l_i, zeros_s,
                                            offs_q, q_start, start_k, qk_scale, BN, is_causal)
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
# fmt: on
