"""The Triton forward of FlashAttention-2 (handout Algorithm 1): one program per query tile, one pass over
key tiles with an online softmax in float32. With causal masking, key tiles past the diagonal are never
visited, the tiles that straddle the diagonal run a masked copy of the loop while all others run without
any index comparison, and the heaviest query tiles are launched first."""

import triton
import triton.language as tl

from .triton_tiles import (
    LN2,
    LOG2E,
    MASK_BIAS,
    dot_f32,
    head_offset,
    load_rows,
    loop_bounds,
    query_tile,
    store_rows,
)

# Kernels keep the Triton tutorials' dense layout of long argument lists.
# fmt: off

@triton.jit
def _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk, stride_vd,
              bh, H, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
              BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr,
              USE_TMA: tl.constexpr):
    """Online softmax over key tiles [lo, hi); MASKED adds the causal bias and drops padding keys."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = load_rows(K_ptr, off_k, stride_kk, stride_kd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = load_rows(V_ptr, off_v, stride_vk, stride_vd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        s = dot_f32(q, tl.trans(k))
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
        acc = dot_f32(p.to(v.dtype), v, acc * alpha[:, None])
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
    q_start = query_tile(is_causal) * Q_TILE_SIZE
    bh = tl.program_id(1)
    off_q = head_offset(bh, H, stride_qb, stride_qh)
    off_k = head_offset(bh, H, stride_kb, stride_kh)
    off_v = head_offset(bh, H, stride_vb, stride_vh)

    q = load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    scale = tl.cast(scale, tl.float32)  # inductor passes a Python float as fp64, which would promote the math
    qk_scale = scale * LOG2E  # scores in log2 units: exp2 instead of exp
    acc = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    l_i = tl.zeros((Q_TILE_SIZE,), dtype=tl.float32)
    m_i = tl.full((Q_TILE_SIZE,), float("-inf"), dtype=tl.float32)

    unmasked_end, masked_end = loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                              stride_vd, bh, H, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D, K_TILE_SIZE,
                              BLOCK_D, False, is_causal, USE_TMA)
    acc, l_i, m_i = _fwd_loop(acc, l_i, m_i, q, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                              stride_vd, bh, H, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D,
                              K_TILE_SIZE, BLOCK_D, True, is_causal, USE_TMA)

    acc = acc / l_i[:, None]
    lse = (m_i + tl.log2(l_i)) * LN2  # back to natural-log units: L is the contract's logsumexp
    store_rows(O_ptr, acc, head_offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES,
                q_start, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)
    tl.store(L_ptr + bh.to(tl.int64) * N_QUERIES + offs_q, lse, mask=offs_q < N_QUERIES)


# ----------------------------------------------------------------------------------------------------------
# Backward: dQ pass first (it also writes D = rowsum(dO ∘ O) for its rows), then the dK/dV pass
# ----------------------------------------------------------------------------------------------------------
# fmt: on
