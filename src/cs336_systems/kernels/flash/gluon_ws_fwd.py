"""The warp-specialized Gluon forward for Hopper: FA3's forward layout (a TMA producer warp feeding two
consumer warp groups), with ``gluon_fwd``'s overlap inside each consumer.

One CTA per query tile of BM = 128 rows (grid (N_QUERIES / BM, batch * heads), heaviest causal tiles first),
three partitions:

- the default partition (the launch's 4 warps): consumer 0, query rows [0, 64) of the tile;
- worker 1 (4 warps, 240 registers a thread): consumer 1, rows [64, 128);
- worker 2 (1 warp, 24 registers): the producer, which TMA-copies the Q tile once and each key tile's K and V
  into a ring of STAGES slots (``ready[s]``: bytes landed; ``empty[s]``: both consumers are done with slot s).

Why: in ``gluon_fwd`` the two warp groups of a 128-row tile share every barrier and issue their copies
themselves; here each consumer waits only on its own matmuls, so one group's softmax runs under the other's
matmuls (FA3's inter-warpgroup overlap) as well as under its own P V (the intra-warpgroup overlap).
Q, K and V are read head-major or seq-major (``SEQ_MAJOR`` bits 0-2, :func:`.gluon_common._head_origin`):
the model's V is a view of its fused projection. The ring is 3 slots deep: with 2 the producer waits for a
slot that both consumers release only after P V, and the pass is slower. O leaves through the Q tile's
shared memory in 16-byte rows, which pays at short sequences. Tried and dropped: the consumers taking turns to
issue their matmuls (FA3's ping-pong: no gain) and programs of 2 or 4 query tiles (a gain at
(32, 8, 512, 128), losses elsewhere). Measured against the best Triton forward, by shape and ring depth:
docs/perf-notes.md, FlashAttention-2, "Warp-specialized passes", "16-byte epilogues" and "Figures moved out
of docstrings".
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .gluon_common import (
    LN2,
    LOG2E,
    _head_origin,
    _o_offsets,
    _query_program,
    _register_operand,
    _restage,
    _wgmma_layout,
)
from .gluon_fwd import _fwd_step, _softmax_tile

HALF = gl.constexpr(64)  # query rows per consumer warp group


# fmt: off
@gluon.jit
def _key_ring_ws(k_desc, v_desc, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr):
    """The K/V ring of a warp-specialized query-tile program (forward, dQ) and its barriers: ``ready[s]``
    (the producer's bytes landed) and ``empty[s]`` (both consumers released slot s); and the barrier of the
    program's own row tiles (Q, or Q and dO)."""
    k_ring = gl.allocate_shared_memory(k_desc.dtype, [STAGES, BN, D], k_desc.layout)
    v_ring = gl.allocate_shared_memory(v_desc.dtype, [STAGES, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)  # both consumers release a slot
    return k_ring, v_ring, q_bar, ready, empty


@gluon.jit
def _invalidate_ring(q_bar, ready, empty, STAGES: gl.constexpr):
    mbarrier.invalidate(q_bar)
    for i in gl.static_range(STAGES):
        mbarrier.invalidate(ready.index(i))
        mbarrier.invalidate(empty.index(i))


@gluon.jit
def _stream_key_tiles(k_desc, v_desc, k_ring, v_ring, ready, empty, bh, H, N_KEYS, n_tiles, BN: gl.constexpr,
                      D: gl.constexpr, STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr):
    """A producer's loop over key tiles (the forward's and the dQ pass's): tile j into slot j % STAGES once
    both consumers released it. A fresh barrier's phase "before" phase 0 counts as complete, so the first
    round's waits pass at once."""
    k_row, k_col = _head_origin(bh, H, N_KEYS, SEQ_MAJOR & 2, D)
    v_row, v_col = _head_origin(bh, H, N_KEYS, SEQ_MAJOR & 4, D)
    for j in range(n_tiles):
        stage = j % STAGES
        mbarrier.wait(empty.index(stage), ((j // STAGES) & 1) ^ 1)
        bar = ready.index(stage)
        mbarrier.expect(bar, 2 * k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [k_row + j * BN, k_col], bar, k_ring.index(stage))
        tma.async_copy_global_to_shared(v_desc, [v_row + j * BN, v_col], bar, v_ring.index(stage))


@gluon.jit
def _fwd_producer(q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, bh, H, N_QUERIES, N_KEYS,
                  q_start, n_tiles, BN: gl.constexpr, D: gl.constexpr, STAGES: gl.constexpr,
                  SEQ_MAJOR: gl.constexpr):
    """One warp: the Q tile, then the key tiles."""
    q_row, q_col = _head_origin(bh, H, N_QUERIES, SEQ_MAJOR & 1, D)
    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row + q_start, q_col], q_bar, q_smem)
    _stream_key_tiles(k_desc, v_desc, k_ring, v_ring, ready, empty, bh, H, N_KEYS, n_tiles, BN, D, STAGES,
                      SEQ_MAJOR)


@gluon.jit
def _fwd_consume(c: gl.constexpr, q_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, stride_ob, stride_oh,
                 stride_on, H, N_QUERIES, q_start, n_tiles, qk_scale, BN: gl.constexpr, D: gl.constexpr,
                 is_causal: gl.constexpr, STAGES: gl.constexpr):
    """Consumer ``c`` (a 4-warp partition): O and L of query rows [q_start + 64 c, q_start + 64 c + 64).
    Key tile j's S is issued with tile j - 1's P V, and its softmax runs under that P V (``gluon_fwd``'s
    loop); tile j - 1's slot is released once both are done."""
    dtype: gl.constexpr = q_smem.dtype
    s_layout: gl.constexpr = _wgmma_layout(4, BN)
    o_layout: gl.constexpr = _wgmma_layout(4, D)
    p_layout: gl.constexpr = _register_operand(o_layout)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)

    q0 = q_start + c * HALF
    q_half = q_smem.slice(c * HALF, HALF)
    offs_q = q0 + gl.arange(0, HALF, layout=rows_s)
    zeros_s = gl.zeros([HALF, BN], gl.float32, s_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, rows_s)
    l_i = gl.zeros([HALF], gl.float32, rows_s)
    acc = gl.zeros([HALF, D], gl.float32, o_layout)

    mbarrier.wait(q_bar, 0)
    mbarrier.wait(ready.index(0), 0)
    s = warpgroup_mma(q_half, k_ring.index(0).permute((1, 0)), zeros_s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(0, deps=(s,))
    p, m_i, l_i, alpha = _softmax_tile(s, m_i, l_i, offs_q, q0, 0, qk_scale, BN, is_causal)
    for j in range(1, n_tiles):
        stage = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(stage), (j // STAGES) & 1)
        p, m_i, l_i, alpha, acc = _fwd_step(q_half, k_ring.index(stage), v_ring.index(prev), p, acc, m_i, l_i,
                                            zeros_s, offs_q, q0, j * BN, qk_scale, BN, is_causal)
        mbarrier.arrive(empty.index(prev), count=1)  # this consumer is done with tile j - 1's K and V
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(gl.convert_layout(p.to(dtype), p_layout), v_ring.index(last), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))

    # O goes out through this consumer's half of the Q tile, which no matmul reads any more.
    o = _restage(acc / gl.convert_layout(l_i, rows_o)[:, None], q_half)
    vectors: gl.constexpr = o.type.layout
    bh = gl.program_id(1)  # read again here rather than kept across the loop (as the dK/dV consumers do)
    gl.store(O_ptr + _o_offsets(bh, q0, stride_ob, stride_oh, stride_on, H, HALF, D, vectors), o)
    # Natural-log units: L is the contract's logsumexp.
    gl.store(L_ptr + bh.to(gl.int64) * N_QUERIES + offs_q, (m_i + gl.log2(l_i)) * LN2)


@gluon.jit
def flash_fwd_ws_kernel(
    q_desc, k_desc, v_desc, O_ptr, L_ptr,
    stride_ob, stride_oh, stride_on, H, N_QUERIES, N_KEYS, scale,
    D: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, is_causal: gl.constexpr, WARPS: gl.constexpr,
    STAGES: gl.constexpr, SEQ_MAJOR: gl.constexpr,
):
    """``flash_fwd_gluon_kernel``'s parameters (Q's descriptor of [BM, D] boxes, K's and V's of [BN, D]) plus
    ``SEQ_MAJOR``; launch with num_warps = WARPS = 4 (the default partition; the workers add 4 + 1 warps)."""
    gl.static_assert(WARPS == 4, "the default partition is one warp group: launch with num_warps=4")
    gl.static_assert(BM == 2 * HALF, "two consumer warp groups of 64 query rows")
    dtype: gl.constexpr = q_desc.dtype
    bh, q_start, n_tiles = _query_program(N_QUERIES, N_KEYS, BM, BN, is_causal)

    q_smem = gl.allocate_shared_memory(dtype, [BM, D], q_desc.layout)
    k_ring, v_ring, q_bar, ready, empty = _key_ring_ws(k_desc, v_desc, BN, D, STAGES)
    qk_scale = scale * LOG2E
    gl.warp_specialize([
        (_fwd_consume, (0, q_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, stride_ob, stride_oh,
                        stride_on, H, N_QUERIES, q_start, n_tiles, qk_scale, BN, D, is_causal, STAGES)),
        (_fwd_consume, (1, q_smem, k_ring, v_ring, q_bar, ready, empty, O_ptr, L_ptr, stride_ob, stride_oh,
                        stride_on, H, N_QUERIES, q_start, n_tiles, qk_scale, BN, D, is_causal, STAGES)),
        (_fwd_producer, (q_desc, k_desc, v_desc, q_smem, k_ring, v_ring, q_bar, ready, empty, bh, H, N_QUERIES,
                         N_KEYS, q_start, n_tiles, BN, D, STAGES, SEQ_MAJOR)),
    ], [4, 1], [240, 24])

    _invalidate_ring(q_bar, ready, empty, STAGES)
# fmt: on
