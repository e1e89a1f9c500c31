"""What the Gluon (Hopper) kernels of FlashAttention-2 share: wgmma layouts, row reductions, the K/V ring of
the query-tile programs (forward, dQ), the program's tile, and O's strided offsets.

Why Gluon: Triton 3.6 waits for every matmul whose result is not a loop-carried accumulator right after
issuing it, so the tensor cores idle while the exponentials and elementwise products are computed. The
Gluon kernels (``gluon_fwd``, ``gluon_bwd``) keep a matmul running under them (FA3's intra-warpgroup
overlap, without its producer warps). No accumulator is left in flight across a loop's back edge: ptxas
then serializes every wgmma of the kernel (C7514). Tiles stream through a TMA ring with mbarriers.
Constraints (:func:`select.gluon_refusal`): Hopper, bf16/fp16, head dim 64 or 128, contiguous (batch,
heads, seq, d) tensors whose lengths are multiples of the tiles, so that 2-D descriptors over (batch *
heads * seq, d) rows never cross a head (the dK/dV and the warp-specialized passes also take seq-major
tensors, :func:`_head_origin`); elsewhere the Triton kernel with the same tiles runs.
"""

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

LOG2E = gl.constexpr(1.4426950408889634)
LN2 = gl.constexpr(0.6931471805599453)


# fmt: off
@gluon.constexpr_function
def _wgmma_layout(warps, n):
    """The register layout of a wgmma result with N = ``n`` columns, ``warps`` warps along M."""
    return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[warps, 1], instr_shape=[16, n, 16])



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
def _head_origin(bh, H, N, SEQ_MAJOR: gl.constexpr, D: gl.constexpr):
    """Where head ``bh``'s rows start in its tensor's 2-D descriptor (``launch._head_rows``): (row, column).
    Head-major tensors (contiguous (batch, heads, seq, d)) are [batch * heads * seq, d] rows; seq-major
    ones (the model's V, a view of the fused QKV, and dO in O's layout) are [batch * seq, heads * d]."""
    if SEQ_MAJOR:
        return (bh // H) * N, (bh % H) * D
    else:
        return bh * N, 0


@gluon.jit
def _o_offsets(bh, q_start, stride_ob, stride_oh, stride_on, H, BM: gl.constexpr, D: gl.constexpr, layout):
    """Offsets of a [BM, D] tile of O in ``layout``: O is strided (the plan stores it as (batch, seq, heads,
    d), so that the model's merge of heads is a view), only its d axis is contiguous."""
    rows = q_start + gl.arange(0, BM, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    base = (bh // H).to(gl.int64) * stride_ob + (bh % H).to(gl.int64) * stride_oh
    return base + rows.to(gl.int64)[:, None] * stride_on + cols[None, :]


@gluon.constexpr_function
def _row_vectors(rows, cols, warps):
    """A layout of 16-byte row vectors of a [rows, cols] tile of 2-byte elements, for the epilogues of the
    warp-specialized passes: a warp's stores cover whole rows. The wgmma accumulator layout holds 2 adjacent
    columns a thread, so storing from it takes 4-byte stores, each warp's spread over 8 rows: at short
    sequences (4-8 tiles a program) that cost a measurable share of a pass (docs/perf-notes.md,
    FlashAttention-2, "16-byte epilogues")."""
    lanes = min(cols // 8, 32)
    return gl.BlockedLayout([1, 8], [32 // lanes, lanes], [warps, 1], [1, 0])


@gluon.jit
def _restage(x, smem):
    """``x`` (a [rows, cols] accumulator), cast to ``smem``'s dtype and read back from ``smem`` (a tile of
    that shape no matmul reads any more) in 16-byte row vectors (:func:`_row_vectors`). Unlike
    ``gl.convert_layout`` it needs no scratch shared memory, of which the forward's ring leaves none; the dQ
    pass, which would have room, was measured this way."""
    layout: gl.constexpr = _row_vectors(x.type.shape[0], x.type.shape[1], gl.num_warps())
    smem.store(x.to(smem.dtype))
    return smem.load(layout)


@gluon.jit
def _store_rows(ptr, x, bh, H, N, row0, SEQ_MAJOR: gl.constexpr, D: gl.constexpr):
    """Rows [row0, row0 + len(x)) of head ``bh`` of a dense gradient (dQ, dK, dV): head-major rows of D, or
    seq-major rows of H * D, as ``empty_like`` lays out the gradient of the model's seq-major V. 64-bit
    offsets: 32-bit ones within the tile made ptxas spill in the split pass at d = 128 with two warp groups."""
    layout: gl.constexpr = x.type.layout
    ROWS: gl.constexpr = x.type.shape[0]
    head_row, col0 = _head_origin(bh, H, N, SEQ_MAJOR, D)
    if SEQ_MAJOR:  # noqa: SIM108
        row_stride = H * D
    else:
        row_stride = D
    rows = (head_row + row0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))).to(gl.int64)
    cols = col0 + gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    gl.store(ptr + rows[:, None] * row_stride + cols[None, :], x.to(ptr.dtype.element_ty))
# fmt: on
