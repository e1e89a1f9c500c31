"""The warp-specialized one-pass backward for Hopper: the dK/dV pass of ``gluon_ws_bwd`` that also adds each
tile pair's share of dQ = dS K into a zeroed float32 accumulator, so that the backward is five matmuls per
tile pair instead of the split backward's seven (no dQ pass recomputing S and dP).

Layout (FA3's): one CTA per key tile of BN = 128 keys, a producer warp streaming the query tiles (Q, dO,
L, D), and two consumer warp groups of 64 keys each, which compute S^T, dP^T, dV and dK of their keys as
the split pass does. Then:

- each consumer puts its dS^T (64 keys x BM queries) into its half of a shared [BN, BM] buffer, double
  buffered by the tile's parity, and the two wait for each other at an mbarrier;
- consumer c computes dQ's columns [c d/2, (c + 1) d/2) = dS (all BN keys, the buffer's transposed view)
  times the same columns of K: the warp groups split dQ's columns, so at d = 128 its accumulator is 32
  registers a thread beside dK's and dV's 64 + 64;
- the share, scaled, goes through shared memory and is added into the accumulator by the copy engine
  (``cp.reduce.async.bulk.tensor``), which finishes it under the next tile's matmuls.

A buffer of parity b is rewritten two tiles later only after both consumers passed the next tile's
mbarrier, which each reaches after waiting for its own dQ matmul of this tile: no other barrier is needed.

D and the zeroed accumulator come from ``triton_bwd.flash_bwd_delta_kernel``; the plan casts dQ from the
accumulator (``plan.OnePassBackward``). The tuner chooses it at (1, 32, 32768, 128) causal; at (4, 16, 1024)
and (32, 8, 512) it is slower than the split backward, which the tuner keeps there. The non-specialized
one-pass kernels that came before it lost at 32k: there every shared-memory hand-off was a
CTA-wide barrier; here each consumer synchronizes within its own warp group, and with the other only at dS.
Measured against the split backward and cuDNN: docs/perf-notes.md, FlashAttention-2, "Warp-specialized
one-pass backward".
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .compat import reduce_add_async as _reduce_add_async
from .gluon_bwd import _probs_t
from .gluon_common import LOG2E, _register_operand, _wgmma_layout
from .gluon_ws_bwd import HALF, _key_program_ws, _producer, _ring_barriers, _store_key_rows
from .gluon_ws_fwd import _invalidate_ring


# fmt: off
@gluon.jit
def _consumer_start(c: gl.constexpr, k_smem, v_smem, k_start, BM: gl.constexpr, D: gl.constexpr):
    """What consumer ``c`` starts from: its halves of the K and V tiles, the end of its keys, their indices,
    zeroed dK and dV (the wgmma accumulator layout) and S^T's zeros."""
    s_layout: gl.constexpr = _wgmma_layout(4, BM)
    acc_layout: gl.constexpr = _wgmma_layout(4, D)
    key0 = k_start + c * HALF
    offs_k = key0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    dk = gl.zeros([HALF, D], gl.float32, acc_layout)
    dv = gl.zeros([HALF, D], gl.float32, acc_layout)
    zeros_s = gl.zeros([HALF, BM], gl.float32, s_layout)
    return k_smem.slice(c * HALF, HALF), v_smem.slice(c * HALF, HALF), key0 + HALF, offs_k, dk, dv, zeros_s


@gluon.jit
def _dkdv_tile(k_half, v_half, q_buf, do_buf, l_buf, delta_buf, dk, dv, zeros_s, start_q, key_end, offs_k, qk_scale,
               is_causal: gl.constexpr):
    """One query tile's dK/dV work: S^T and dP^T issued together, P^T under dP^T, dS^T under dV += P^T dO.
    Returns dK and dV with their matmuls (dV += P^T dO, dK += dS^T Q) still in flight, and dS^T in Q's
    dtype. The same steps as the split pass's loop (``gluon_ws_bwd._consume``), kept apart: calling this
    from there changed that kernel's SASS and slowed it at (1, 32, 32768, 128), while this kernel ran faster
    with it than with the loop written out (docs/perf-notes.md, FlashAttention-2, "Figures moved out of
    docstrings")."""
    dtype: gl.constexpr = q_buf.dtype
    BM: gl.constexpr = q_buf.type.shape[0]
    s_layout: gl.constexpr = zeros_s.type.layout
    a_layout: gl.constexpr = _register_operand(dk.type.layout)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    s_t = warpgroup_mma(k_half, q_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    dp_t = warpgroup_mma(v_half, do_buf.permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    offs_q = start_q + gl.arange(0, BM, layout=q_vec)
    lse2 = l_buf.load(q_vec) * LOG2E
    s_t = warpgroup_mma_wait(1, deps=(s_t,))  # S^T is ready; dP^T runs on under the exponentials
    if is_causal:
        if start_q < key_end:  # query tiles starting before key_end straddle (or precede) the diagonal
            p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, True)
        else:
            p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
    else:
        p_t = _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, False)
    dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do_buf, dv, is_async=True)
    dp_t = warpgroup_mma_wait(1, deps=(dp_t,))  # dP^T is ready; dV += P^T dO runs on under dS^T
    # D read only now: its 16 registers a thread are not live across the exponentials (spills at d=128).
    delta = delta_buf.load(q_vec)
    ds_t = (p_t * (dp_t - delta[None, :])).to(dtype)
    dk = warpgroup_mma(gl.convert_layout(ds_t, a_layout), q_buf, dk, is_async=True)
    return dk, dv, ds_t


@gluon.jit
def _consume(c: gl.constexpr, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, ds_smem,
             ds_bar, dq_smem, dq_acc_desc, dq_row0, k_start, lo, n_tiles, scale, qk_scale, BM: gl.constexpr,
             D: gl.constexpr, is_causal: gl.constexpr, STAGES: gl.constexpr):
    """Consumer ``c``: dK, dV of keys [k_start + 64 c, + 64) (unscaled), and dQ's columns [c D/2, + D/2) of
    each query tile added into the accumulator."""
    DQ_COLS: gl.constexpr = D // 2
    k_half, v_half, key_end, offs_k, dk, dv, zeros_s = _consumer_start(c, k_smem, v_smem, k_start, BM, D)
    k_cols = k_smem.slice(c * DQ_COLS, DQ_COLS, dim=1)  # dQ's B operand: all keys, this consumer's columns
    dq_layout: gl.constexpr = _wgmma_layout(4, DQ_COLS)
    zeros_dq = gl.zeros([BM, DQ_COLS], gl.float32, dq_layout)
    mbarrier.wait(kv_bar, 0)
    for i in range(n_tiles):
        stage = i % STAGES
        start_q = lo + i * BM
        mbarrier.wait(ready.index(stage), (i // STAGES) & 1)
        dk, dv, ds_t = _dkdv_tile(k_half, v_half, q_ring.index(stage), do_ring.index(stage), l_ring.index(stage),
                                  delta_ring.index(stage), dk, dv, zeros_s, start_q, key_end, offs_k, qk_scale,
                                  is_causal)
        # This consumer's rows of dS^T, then the other's: dQ needs all BN keys.
        buf = ds_smem.index(i % 2)
        buf.slice(c * HALF, HALF).store(ds_t)
        fence_async_shared()  # visible to the matmuls (the async proxy)
        gl.thread_barrier()  # from all of this warp group's threads before its one arrival
        mbarrier.arrive(ds_bar.index(i % 2), count=1)
        mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)
        dq = warpgroup_mma(buf.permute((1, 0)), k_cols, zeros_dq, use_acc=False, is_async=True)
        dv, dk, dq = warpgroup_mma_wait(0, deps=(dv, dk, dq))
        mbarrier.arrive(empty.index(stage), count=1)
        tma.store_wait(0)  # the previous tile's reduction has read dq_smem
        dq_smem.store(dq * scale)
        fence_async_shared()
        gl.thread_barrier()
        _reduce_add_async(dq_acc_desc, [dq_row0 + start_q, c * DQ_COLS], dq_smem)
    tma.store_wait(0)
    return dk, dv


@gluon.jit
def _one_pass_consumer(c: gl.constexpr, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty,
                       ds_smem, ds_bar, dq_smem, dq_acc_desc, dK_ptr, dV_ptr, H, N_QUERIES, k_start, lo, n_tiles,
                       N_KEYS, scale, qk_scale, BM: gl.constexpr, D: gl.constexpr, is_causal: gl.constexpr,
                       STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr):
    dk, dv = _consume(c, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, ds_smem,
                      ds_bar, dq_smem.index(c), dq_acc_desc, gl.program_id(1) * N_QUERIES, k_start, lo, n_tiles,
                      scale, qk_scale, BM, D, is_causal, STAGES)
    _store_key_rows(c, dk, dv, dK_ptr, dV_ptr, H, N_KEYS, k_start, scale, D, SEQ_MAJOR)


@gluon.jit
def flash_bwd_one_pass_ws_kernel(
    q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, dK_ptr, dV_ptr, dq_acc_desc,
    H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr,
):
    """``flash_bwd_dkdv_ws_kernel``'s parameters plus ``dq_acc_desc``: [BM, 64] boxes over the zeroed float32
    accumulator, head-major rows [batch * heads * N_QUERIES, D]. D = rowsum(dO ∘ O) must be in ``delta``."""
    gl.static_assert(WARPS == 4, "the default partition is one warp group: launch with num_warps=4")
    gl.static_assert(BN == 2 * HALF, "two consumer warp groups of 64 keys")
    dtype: gl.constexpr = q_desc.dtype
    bh, k_start, lo, n_tiles, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring = _key_program_ws(
        q_desc, k_desc, v_desc, do_desc, l_desc, delta_desc, H, N_QUERIES, N_KEYS, BM, BN, D, is_causal, STAGES,
        SEQ_MAJOR)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], dtype)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BN, BM], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [2, BM, D // 2], dq_acc_desc.layout)
    ready, empty = _ring_barriers(STAGES)
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)  # both consumers' halves of dS^T stored
    qk_scale = scale * LOG2E
    gl.warp_specialize([
        (_one_pass_consumer, (0, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, ds_smem,
                              ds_bar, dq_smem, dq_acc_desc, dK_ptr, dV_ptr, H, N_QUERIES, k_start, lo, n_tiles,
                              N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES, SEQ_MAJOR)),
        (_one_pass_consumer, (1, k_smem, v_smem, kv_bar, q_ring, do_ring, l_ring, delta_ring, ready, empty, ds_smem,
                              ds_bar, dq_smem, dq_acc_desc, dK_ptr, dV_ptr, H, N_QUERIES, k_start, lo, n_tiles,
                              N_KEYS, scale, qk_scale, BM, D, is_causal, STAGES, SEQ_MAJOR)),
        (_producer, (q_desc, do_desc, l_desc, delta_desc, q_ring, do_ring, l_ring, delta_ring, ready, empty, bh, H,
                     N_QUERIES, lo, n_tiles, BM, D, STAGES, SEQ_MAJOR)),
    ], [4, 1], [240, 24])

    _invalidate_ring(kv_bar, ready, empty, STAGES)
    for i in gl.static_range(2):
        mbarrier.invalidate(ds_bar.index(i))
# fmt: on
