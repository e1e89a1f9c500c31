"""The dK/dV pass of the FlashAttention-2 backward in Gluon, for Hopper: the same math as
``flash_attention.flash_bwd_dkdv_kernel`` (split backward, D written by the dQ pass), with the matmuls
issued asynchronously by hand.

Why Gluon: Triton 3.6 waits for every matmul whose result is not a loop-carried accumulator right after
issuing it, so in its dK/dV loop the tensor cores idle while P = exp2(S - L) and dS = P (dP - D) are
computed. Here S^T and dP^T are issued together, P^T is computed while dP^T runs, and dS^T while dV += P^T dO
runs (FA3's intra-warpgroup overlap, without its producer warps). Q and dO tiles stream through a two-stage
TMA ring.

Constraints (checked by :func:`gluon_dkdv_supported`): Hopper, bf16/fp16, head dim 64 or 128, Q/K/V/dO
contiguous (batch, heads, seq, d) so that 2-D descriptors over (batch * heads * seq, d) rows never cross a
head (seq_q a multiple of the query tile, seq_k of the key tile), dK/dV contiguous.
"""

from __future__ import annotations

import math

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

LOG2E = gl.constexpr(1.4426950408889634)


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
def _probs_t(s_t, lse2, offs_q, offs_k, qk_scale, MASKED: gl.constexpr):
    """P^T = exp2(S^T * scale * log2(e) - L * log2(e)), zero where a query precedes a key (causal)."""
    x = s_t * qk_scale - lse2[None, :]
    if MASKED:
        x = gl.where(offs_q[None, :] >= offs_k[:, None], x, float("-inf"))
    return gl.exp2(x)


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
    bh = gl.program_id(1)
    k_start = gl.program_id(0) * BN
    q_row0 = bh * N_QUERIES

    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                       instr_shape=[16, BM, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS, 1],
                                                         instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    q_vec: gl.constexpr = gl.SliceLayout(0, s_layout)
    k_vec: gl.constexpr = gl.SliceLayout(1, s_layout)

    k_smem = gl.allocate_shared_memory(dtype, [BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dtype, [BN, D], v_desc.layout)
    q_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], q_desc.layout)
    do_ring = gl.allocate_shared_memory(dtype, [STAGES, BM, D], do_desc.layout)
    l_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], l_desc.layout)
    delta_ring = gl.allocate_shared_memory(gl.float32, [STAGES, BM], delta_desc.layout)
    bars = gl.allocate_shared_memory(gl.int64, [STAGES + 1, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES + 1):
        mbarrier.init(bars.index(i), count=1)

    # Causal: query tiles before k_start see none of these keys; those in [k_start, k_start + BN) straddle
    # the diagonal.
    if is_causal:  # noqa: SIM108
        lo = k_start
    else:
        lo = 0
    n_tiles = (N_QUERIES - lo) // BM
    diag_end = k_start + BN

    kv_bar = bars.index(STAGES)
    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [bh * N_KEYS + k_start, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [bh * N_KEYS + k_start, 0], kv_bar, v_smem)
    _load_query_tile(q_desc, do_desc, l_desc, delta_desc, q_row0 + lo, bars.index(0), q_ring, do_ring, l_ring,
                     delta_ring, 0, n_tiles > 0)
    mbarrier.wait(kv_bar, 0)

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

    rows = k_start + gl.arange(0, BN, layout=gl.SliceLayout(1, acc_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, acc_layout))
    offs = (bh.to(gl.int64) * N_KEYS + rows[:, None]) * D + cols[None, :]
    gl.store(dK_ptr + offs, (dk * scale).to(dtype))
    gl.store(dV_ptr + offs, dv.to(dtype))
# fmt: on


SUPPORTED_D = (64, 128)


def gluon_dkdv_supported(q_tile: int, k_tile: int, q, k, v, do, lse, delta, dk, dv) -> bool:
    """Whether the Gluon dK/dV pass can run this call (otherwise the caller runs the Triton pass with the
    same tiles): a Hopper GPU (wgmma), 2-byte floats, d of 64 or 128, contiguous (batch, heads, seq, d)
    tensors whose sequence lengths are multiples of the tiles (2-D descriptors over all rows then never
    cross a head), and diagonal tiles that line up with the query steps."""
    tensors = (q, k, v, do, dk, dv)
    if not q.is_cuda or torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    if q.dtype not in (torch.bfloat16, torch.float16) or any(t.dtype != q.dtype for t in tensors):
        return False
    if q.shape[-1] not in SUPPORTED_D or not all(t.is_contiguous() for t in (*tensors, lse, delta)):
        return False
    return q.shape[2] % q_tile == 0 and k.shape[2] % k_tile == 0 and k_tile % q_tile == 0


def _gl_dtype(dtype: torch.dtype):
    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[dtype]


def _descriptor(flat: torch.Tensor, box: list[int]) -> TensorDescriptor:
    """A descriptor of ``box``-shaped tiles over ``flat``, with the default swizzle for them."""
    layout = gl.NVMMASharedLayout.get_default_for(box, _gl_dtype(flat.dtype))
    return TensorDescriptor(flat, list(flat.shape), list(flat.stride()), box, layout)


def dkdv_gluon_args(q_tile: int, k_tile: int, q, k, v, do, lse, delta, dk, dv) -> tuple:
    """The kernel's arguments for one call: descriptors of [tile, d] boxes over the contiguous (batch,
    heads, seq, d) tensors' rows and of [q_tile] boxes over L and D, then dK, dV, the unread dQ slot, the
    integers and the scale."""
    n_q, n_k, d = q.shape[2], k.shape[2], q.shape[3]
    rows = lambda t, tile: _descriptor(t.view(-1, d), [tile, d])
    vector = lambda t: _descriptor(t.view(-1), [q_tile])
    descs = (rows(q, q_tile), rows(k, k_tile), rows(v, k_tile), rows(do, q_tile), vector(lse), vector(delta))
    return (*descs, dk, dv, dk, n_q, n_k, 1.0 / math.sqrt(d))
