"""The warp-specialized Gluon backward passes for Hopper: FA3's producer/consumer layout for each half of
the split backward. Both read Q, K, V and dO head-major or seq-major (``SEQ_MAJOR``).

The dK/dV pass: one CTA per key tile of BN = 128 keys (grid (N_KEYS / BN, batch * heads), as
:func:`.gluon_bwd.flash_bwd_dkdv_gluon_kernel`, whose leading parameters it shares), three partitions:

- the default partition (the launch's 4 warps): consumer 0, keys [0, 64) of the tile;
- worker 1 (4 warps, 240 registers a thread): consumer 1, keys [64, 128);
- worker 2 (1 warp, 24 registers): the producer, which TMA-copies each query tile's Q, dO, L and D into a
  ring of STAGES slots (``ready[s]``: bytes landed; ``empty[s]``: both consumers are done with slot s).

Why: in the non-specialized kernel the two warp groups share every barrier (7 CTA-wide ``bar.sync`` per
query tile), so each waits for the other's exponentials; here each consumer synchronizes only within its
own 128 threads (2 barriers per tile) and the copies are the producer's alone. The gradients are bitwise
equal to the non-specialized pass's (the same loop body, in the same order). Ordering the consumers' matmul
bursts (ping-pong, by mbarrier turn-passing) lost, and was dropped.

The dQ pass (:func:`flash_bwd_dq_ws_kernel`): the warp-specialized forward's layout (``gluon_ws_fwd``: CTAs
of 128 query rows, a consumer per 64, the producer streaming K and V) around ``gluon_bwd``'s dQ loop. Its key
tiles are 64 keys: with 128 the consumers spill (192 bytes at d = 128).

Both passes store their gradients in 16-byte rows, and the dQ pass reads O so (``gluon_common._row_vectors``),
which pays where a program runs 4-8 tiles (short sequences). Measured against the non-specialized and Triton
passes: docs/perf-notes.md, FlashAttention-2, "Warp-specialized passes", "16-byte epilogues" and "Figures
moved out of docstrings".
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_bwd import _dq_first, _dq_step, _key_tile_start, _load_query_tile, _probs_t
from .gluon_common import (
    LOG2E,
    _head_origin,
    _o_offsets,
    _query_program,
    _register_operand,
    _restage,
    _row_sum,
    _row_vectors,
    _store_rows,
    _wgmma_layout,
)
from .gluon_ws_fwd import _invalidate_ring, _key_ring_ws, _stream_key_tiles

HALF = gl.constexpr(64)  # keys per consumer warp group


# fmt: off
@gluon.jit
def _producer(q_desc, do_desc, l_desc, delta_desc, q_ring, do_ring, l_ring, delta_ring, ready, empty, bh, H,
              N_QUERIES, lo, n_tiles, BM: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
              SEQ_MAJOR: gl.constexpr):
    """One warp: query tile i into slot i % STAGES once both consumers released it. The first round's
    waits pass at once: a fresh barrier's phase "before" phase 0 counts as complete (parity 1)."""
    q_org = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 1, D)
    do_org = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 8, D)
    for i in range(n_tiles):
        stage = i % STAGES
        mbarrier.wait(empty.index(stage), ((i // STAGES) & 1) ^ 1)
        _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_org, do_org, bh * N_QUERIES, lo + i * BM,
                         ready.index(stage), q_ring, do_ring, l_ring, delta_ring, stage, True)


@gluon.jit
def _consume(c: gl.constexpr, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, k_start,
             lo, n_tiles, qk_scale, BM: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr,
             STAGES: gl.constexpr):
    """Consumer ``c`` (a 4-warp partition): dK, dV of keys [k_start + 64 c, k_start + 64 c + 64) over the
    query tiles, unscaled, in the wgmma accumulator layout. The body is the non-specialized kernel's."""
    dtype: gl.constexpr = q_ring.dtype
    s_layout: gl.constexpr = _wgmma_layout(4, BM)
    acc_layout: gl.constexpr = _wgmma_layout(4, D)
    a_layout: gl.constexpr = _register_operand(acc_layout)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_vec: gl.constexpr = gl.SliceLayout(1, s_layout)

    k_half = k_smem.slice(c * HALF, HALF)
    v_half = v_smem.slice(c * HALF, HALF)
    key0 = k_start + c * HALF
    key_end = key0 + HALF  # query tiles starting before it straddle (or precede) this half's diagonal
    offs_k = key0 + gl.arange(0, HALF, layout=k_vec)
    dk = gl.zeros([HALF, D], gl.float32, acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, acc_layout)
    zeros_s = gl.zeros([HALF, BM], gl.float32, s_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        start_q = lo + i * BM
        q_buf = q_ring.index(stage)
        do_buf = do_ring.index(stage)
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        s_t = warpgroup_mma(k_half, q_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        dp_t = warpgroup_mma(v_half, do_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
        offs_q = start_q + gl.arange(0, BM, layout=q_vec)
        lse2 = l_ring.index(stage).load(q_vec) * LOG2E
        s_t = warpgroup_mma_wait(1, deps=(s_t,))  # S^T is ready; dP^T runs on under the exponentials
        if is_causal:
            if start_q < key_end:
                p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, True)
            else:
                p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
        else:
            p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_buf, dv, is_async=True)
        dp_t = warpgroup_mma_wait(1, deps=(dp_t,))  # dP^T is ready; dV += P^T dO runs on under dS^T
        # D read only now: its 16 registers a thread are not live across the exponentials (spills at d=128).
        delta = delta_ring.index(stage).load(q_vec)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q_buf, dk, is_async=True)
        dv, dk = warpgroup_mma_wait(0, deps=(dv, dk))
        mbarrier.arrive(empty.index(stage), count=1)  # this consumer is done with the slot
    return dk, dv


@gluon.jit
def _dkdv_consumer(c: gl.constexpr, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty,
                   dK_ptr, dV_ptr, H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM: gl.constexpr,
                   D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr):
    """Consumer ``c``, which stores its own keys (the head from the program id: a register kept across the
    loop for it made ptxas spill at d = 128)."""
    dk, dv = _consume(c, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, k_start, lo,
                      n_tiles, qk_scale, BM, D, is_causal, STAGES)
    _store_key_rows(c, dk, dv, dK_ptr, dV_ptr, H, N_KEYS, k_start, scale, D, SEQ_MAJOR)


@gluon.jit
def _store_key_rows(c: gl.constexpr, dk, dv, dK_ptr, dV_ptr, H, N_KEYS, k_start, scale, D: gl.constexpr,
                    SEQ_MAJOR: gl.constexpr):
    """Consumer ``c``'s rows of dV and dK (times the scale). In 16-byte row vectors through scratch shared
    memory: restaged through the K and V halves instead, the loop scheduled differently and the pass took
    longer at (1, 32, 32768, 128) than this way (docs/perf-notes.md, FlashAttention-2, "Figures moved out of
    docstrings")."""
    vectors: gl.constexpr = _row_vectors(HALF, D, 4)
    dv = gl.convert_layout(dv.to(dV_ptr.dtype.element_ty), vectors)
    _store_rows(dV_ptr, dv, gl.program_id(1), H, N_KEYS, k_start + c * HALF, SEQ_MAJOR & 32, D)
    dk = gl.convert_layout((dk * scale).to(dK_ptr.dtype.element_ty), vectors)
    _store_rows(dK_ptr, dk, gl.program_id(1), H, N_KEYS, k_start + c * HALF, SEQ_MAJOR & 16, D)


@gluon.jit
def flash_bwd_dkdv_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr,
    H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr,
):
    """``flash_bwd_dkdv_gluon_kernel``'s parameters (the launch's descriptors: Q, dO of [BM, D] boxes, K, V
    of [BN, D], L and D of [BM]), plus the query ring's depth; launch with num_warps = WARPS = 4 (the
    default partition; the workers add 4 + 1 warps, padded to 12 in all)."""
    gl.static_assert(WARPS == 4, "the default partition is one warp group: launch with num_warps=4")
    gl.static_assert(BN == 2 * HALF, "two consumer warp groups of 64 keys")
    bh, k_start, lo, n_tiles, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring = _key_program_ws(
        q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, H, N_QUERIES, N_KEYS, BM, BN, D, is_causal, STAGES,
        SEQ_MAJOR)
    ready, empty = _ring_barriers(STAGES)
    qk_scale = scale * LOG2E
    gl.warp_specialize([
        (_dkdv_consumer, (0, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr,
                          dV_ptr, H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES,
                          SEQ_MAJOR)),
        (_dkdv_consumer, (1, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr,
                          dV_ptr, H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES,
                          SEQ_MAJOR)),
        (_producer, (q_desc, do_desc, l_desc, delta_desc, q_ring, do_ring, l_ring, delta_ring, ready, empty, bh, H,
                     N_QUERIES, lo, n_tiles, BM, D, STAGES, SEQ_MAJOR)),
    ], [4, 1], [240, 24])

    _invalidate_ring(kv_bar, ready, empty, STAGES)


@gluon.jit
def _key_program_ws(q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, H, N_QUERIES, N_KEYS, BM: gl.constexpr,
                    BN: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr,
                    SEQ_MAJOR: gl.constexpr):
    """A warp-specialized key-tile program's start (the dK/dV and one-pass kernels): its head, first key,
    first query and number of query tiles; K and V in flight; the query ring (Q, dO, L, D)."""
    dtype: gl.constexpr = q_desc.dtype
    bh = gl.program_id(1)
    k_start = gl.program_id(0) * BN
    if is_causal:  # noqa: SIM108
        lo = k_start  # query tiles before the key tile see none of its keys
    else:
        lo = 0
    n_tiles = (N_QUERIES - lo) // BM
    k_smem, v_smem, kv_bar = _key_tile_start(k_desc, v_desc, bh, H, N_KEYS, k_start, SEQ_MAJOR, D)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], l_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    return bh, k_start, lo, n_tiles, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring


@gluon.jit
def _ring_barriers(STAGES: gl.constexpr):
    """The query ring's barriers: ``ready[s]`` (the producer's copies landed), ``empty[s]`` (both consumers
    released slot s)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    return ready, empty
# fmt: on


# ----------------------------------------------------------------------------------------------------------
# The dQ pass
# ----------------------------------------------------------------------------------------------------------


# fmt: off
@gluon.jit
def _dq_producer(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_ring, v_ring, q_bar, ready, empty, bh, H,
                 N_QUERIES, N_KEYS, q_start, n_tiles, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                 SEQ_MAJOR: gl.constexpr):
    """One warp: the Q and dO tiles, then the key tiles (as the forward's producer)."""
    q_row, q_col = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 1, D)
    do_row, do_col = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 8, D)
    mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar, q_smem)
    tma.async_copy_global_to_shared(do_desc, [do_row + q_start, do_col], q_bar, do_smem)
    _stream_key_tiles(k_desc, v_desc, k_ring, v_ring, ready, empty, bh, H, N_KEYS, n_tiles, BN, D, STAGES,
                      SEQ_MAJOR)


@gluon.jit
def _dq_consume(c: gl.constexpr, q_smem, do_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, Delta_ptr,
                dQ_ptr, stride_ob, stride_oh, stride_on, H, N_QUERIES, q_start, n_tiles, scale, qk_scale,
                BN: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr,
                SEQ_MAJOR: gl.constexpr):
    """Consumer ``c`` (a 4-warp partition): D = rowsum(dO ∘ O) and dQ of query rows [q_start + 64 c,
    q_start + 64 c + 64). ``gluon_bwd``'s dQ loop: S_j and dP_j are issued with dS_{j-1} K_{j-1}; tile
    j - 1's slot is released once that is done."""
    s_layout: gl.constexpr = _wgmma_layout(4, BN)
    acc_layout: gl.constexpr = _wgmma_layout(4, D)
    ds_layout: gl.constexpr = _register_operand(acc_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    vectors: gl.constexpr = _row_vectors(HALF, D, 4)

    bh = gl.program_id(1)
    q0 = q_start + c * HALF
    q_half = q_smem.slice(c * HALF, HALF)
    do_half = do_smem.slice(c * HALF, HALF)
    offs_q = q0 + gl.arange(0, HALF, layout=rows_s)
    stat = bh.to(gl.int64) * N_QUERIES + offs_q
    # O by pointer (read once, in 16-byte row vectors) while the tiles load.
    o = gl.load(O_ptr + _o_offsets(bh, q0, stride_ob, stride_oh, stride_on, H, HALF, D, vectors))
    lse2 = gl.load(L_ptr + stat) * LOG2E
    mbarrier.wait(q_bar, 0)
    delta = gl.convert_layout(_row_sum(o.to(gl.float32) * do_half.load(vectors).to(gl.float32)), rows_s)
    gl.store(Delta_ptr + stat, delta)

    zeros_s = gl.zeros([HALF, BN], gl.float32, s_layout)
    dq = gl.zeros([HALF, D], gl.float32, acc_layout)
    mbarrier.wait(ready.index(0), 0)
    ds = _dq_first(q_half, do_half, k_ring.index(0), v_ring.index(0), zeros_s, lse2, delta, offs_q, q0, qk_scale, BN,
                   is_causal)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        ds, dq = _dq_step(q_half, do_half, k_ring.index(stage), v_ring.index(stage), k_ring.index(prev), ds, dq,
                          zeros_s, lse2, delta, offs_q, q0, j * BN, qk_scale, BN, is_causal)
        mbarrier.arrive(empty.index(prev), count=1)  # this consumer is done with tile j - 1's K and V
    last = (n_tiles - 1) % STAGES
    dq = warpgroup_mma(gl.convert_layout(ds, ds_layout), k_ring.index(last), dq, is_async=True)
    dq = warpgroup_mma_wait(0, deps=(dq,))
    # Out through this consumer's half of the Q tile, which no matmul reads any more.
    _store_rows(dQ_ptr, _restage(dq * scale, q_half), bh, H, N_QUERIES, q0, SEQ_MAJOR & 16, D)


@gluon.jit
def flash_bwd_dq_ws_kernel(
    q_desc, k_desc, v_desc, O_ptr, do_desc, L_ptr, Delta_ptr, dQ_ptr,
    stride_ob, stride_oh, stride_on, H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr,
):
    """``flash_bwd_dq_gluon_kernel``'s parameters plus ``SEQ_MAJOR`` (Q, K, V, dO, dQ: bits 0-4), one CTA per
    query tile of BM = 128 rows, as the warp-specialized forward: consumers of 64 rows each and a producer
    warp that copies the Q and dO tiles once and streams K and V. Launch with num_warps = WARPS = 4."""
    gl.static_assert(WARPS == 4, "the default partition is one warp group: launch with num_warps=4")
    gl.static_assert(BM == 2 * HALF, "two consumer warp groups of 64 query rows")
    dtype: gl.constexpr = q_desc.dtype
    bh, q_start, n_tiles = _query_program(N_QUERIES, N_KEYS, BM, BN, is_causal)

    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dtype, [BM, D], do_desc.layout)
    k_ring, v_ring, q_bar, ready, empty = _key_ring_ws(k_desc, v_desc, BN, D, STAGES)
    qk_scale = scale * LOG2E
    gl.warp_specialize([
        (_dq_consume, (0, q_smem, do_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, Delta_ptr, dQ_ptr,
                       stride_ob, stride_oh, stride_on, H, N_QUERIES, q_start, n_tiles, scale, qk_scale, BN, D,
                       is_causal, STAGES, SEQ_MAJOR)),
        (_dq_consume, (1, q_smem, do_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, Delta_ptr, dQ_ptr,
                       stride_ob, stride_oh, stride_on, H, N_QUERIES, q_start, n_tiles, scale, qk_scale, BN, D,
                       is_causal, STAGES, SEQ_MAJOR)),
        (_dq_producer, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_ring, v_ring, q_bar, ready, empty, bh,
                        H, N_QUERIES, N_KEYS, q_start, n_tiles, BN, D, STAGES, SEQ_MAJOR)),
    ], [4, 1], [240, 24])

    _invalidate_ring(q_bar, ready, empty, STAGES)
# fmt: on
