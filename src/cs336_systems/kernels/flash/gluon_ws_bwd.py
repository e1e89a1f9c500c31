"""The warp-specialized Gluon dK/dV pass for Hopper: FA3's backward layout for the dK/dV half of the split
backward (the dQ pass is ``gluon_bwd``'s or Triton's, unchanged).

One CTA per key tile of BN = 128 keys (grid (N_KEYS / BN, batch * heads), as
:func:`.gluon_bwd.flash_bwd_dkdv_gluon_kernel`, whose leading parameters it shares), three partitions:

- the default partition (the launch's 4 warps): consumer 0, keys [0, 64) of the tile;
- worker 1 (4 warps, 240 registers a thread): consumer 1, keys [64, 128);
- worker 2 (1 warp, 24 registers): the producer, which TMA-copies each query tile's Q, dO, L and D into a
  ring of STAGES slots (``ready[s]``: bytes landed; ``empty[s]``: both consumers are done with slot s).

Why: in the non-specialized kernel the two warp groups share every barrier (7 CTA-wide ``bar.sync`` per
query tile), so each waits for the other's exponentials; here each consumer synchronizes only within its
own 128 threads (2 barriers per tile) and the copies are the producer's alone. Measured on an H100
(session 19): 0.86x the time of the non-specialized pass at (1, 32, 32768, 128) causal, 24.7 vs 28.7 ms,
bitwise equal gradients (the same loop body, in the same order). Ordering the consumers' matmul bursts
(ping-pong, by mbarrier turn-passing) lost: 0.93x.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, warpgroup_mma, warpgroup_mma_wait

from .gluon_bwd import _key_tile_start, _load_query_tile, _probs_t, _store_key_rows
from .gluon_common import LOG2E, _head_origin, _register_operand, _wgmma_layout

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
def _consumer0(k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr, dV_ptr,
               H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM: gl.constexpr, D: gl.constexpr,
               is_causal: gl.constexpr, STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr):
    """The default partition: consumer 0, which stores its own keys (the head from the program id: a
    register kept across the loop for it made ptxas spill at d = 128)."""
    dk, dv = _consume(0, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, k_start, lo,
                      n_tiles, qk_scale, BM, D, is_causal, STAGES)
    _store_key_rows(dV_ptr, dv, gl.program_id(1), H, N_KEYS, k_start, SEQ_MAJOR & 32, D)
    _store_key_rows(dK_ptr, dk * scale, gl.program_id(1), H, N_KEYS, k_start, SEQ_MAJOR & 16, D)


@gluon.jit
def _consumer1(k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr, dV_ptr,
               H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM: gl.constexpr, D: gl.constexpr,
               is_causal: gl.constexpr, STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr):
    dk, dv = _consume(1, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, k_start, lo,
                      n_tiles, qk_scale, BM, D, is_causal, STAGES)
    _store_key_rows(dV_ptr, dv, gl.program_id(1), H, N_KEYS, k_start + HALF, SEQ_MAJOR & 32, D)
    _store_key_rows(dK_ptr, dk * scale, gl.program_id(1), H, N_KEYS, k_start + HALF, SEQ_MAJOR & 16, D)


@gluon.jit
def flash_bwd_dkdv_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr,
    H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    SEQ_MAJOR: gl.constexpr, STAGES: gl.constexpr,
):
    """``flash_bwd_dkdv_gluon_kernel``'s parameters (the launch's descriptors: Q, dO of [BM, D] boxes, K, V
    of [BN, D], L and D of [BM]), plus the query ring's depth; launch with num_warps = WARPS = 4 (the
    default partition; the workers add 4 + 1 warps, padded to 12 in all)."""
    gl.static_assert(WARPS == 4, "the default partition is one warp group: launch with num_warps=4")
    gl.static_assert(BN == 2 * HALF, "two consumer warp groups of 64 keys")
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
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    qk_scale = scale * LOG2E
    gl.warp_specialize([
        (_consumer0, (k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr, dV_ptr,
                      H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES, SEQ_MAJOR)),
        (_consumer1, (k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, dK_ptr, dV_ptr,
                      H, k_start, lo, n_tiles, N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES, SEQ_MAJOR)),
        (_producer, (q_desc, do_desc, l_desc, delta_desc, q_ring, do_ring, l_ring, delta_ring, ready, empty, bh, H,
                     N_QUERIES, lo, n_tiles, BM, D, STAGES, SEQ_MAJOR)),
    ], [4, 1], [240, 24])

    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))
    mbarrier.invalidate(kv_bar)
# fmt: on
