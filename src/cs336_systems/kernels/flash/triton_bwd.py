"""The Triton backward of FlashAttention-2 (handout Algorithm 2, equations 13-19) in two launches and no
atomics, so the gradients are the same bit for bit on every run: a dQ pass over key tiles that also
computes D = rowsum(dO ∘ O) for its rows and stores it, then a dK/dV pass over query tiles that reads D.
Each recomputes P from L. (A one-pass backward in Triton, adding dQ's shares atomically from the dK/dV
pass, lost beyond short sequences and was removed: docs/perf-notes.md, FlashAttention-2, "The stack as a
package". The warp-specialized
Gluon one-pass backward, ``gluon_ws_one_pass``, takes its D and zeroed accumulator from
:func:`flash_bwd_delta_kernel`.)"""

import triton
import triton.language as tl

from .triton_tiles import LOG2E, dot_f32, head_offset, load_rows, loop_bounds, query_tile, store_rows

# fmt: off

@triton.jit
def _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk, stride_vd,
             bh, H, offs_q, lo, hi, N_KEYS, qk_scale, D: tl.constexpr, K_TILE_SIZE: tl.constexpr,
             BLOCK_D: tl.constexpr, MASKED: tl.constexpr, is_causal: tl.constexpr, USE_TMA: tl.constexpr):
    """Accumulate dQ of one query tile over key tiles [lo, hi)."""
    for start_k in range(lo, hi, K_TILE_SIZE):
        k = load_rows(K_ptr, off_k, stride_kk, stride_kd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        v = load_rows(V_ptr, off_v, stride_vk, stride_vd, bh, H, N_KEYS, start_k, D, K_TILE_SIZE, BLOCK_D,
                       MASKED, USE_TMA)
        s = dot_f32(q, tl.trans(k))
        if MASKED:
            offs_k = start_k + tl.arange(0, K_TILE_SIZE)
            keep = offs_k[None, :] < N_KEYS  # padding keys: dS there times K = 0 would still give NaN·0
            if is_causal:
                keep = keep & (offs_k[None, :] <= offs_q[:, None])
            p = tl.exp2(tl.where(keep, s * qk_scale - lse2[:, None], float("-inf")))
        else:
            p = tl.exp2(s * qk_scale - lse2[:, None])
        dp = dot_f32(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq = dot_f32(ds.to(k.dtype), k, dq)
    return dq


@triton.jit
def flash_bwd_dq_kernel(
    Q_ptr, K_ptr, V_ptr, O_ptr, dO_ptr, L_ptr, Delta_ptr, dQ_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_dqb, stride_dqh, stride_dqq, stride_dqd,
    H, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """First backward pass: one program per query tile (grid (T_q, batch * heads)) computes D = rowsum(dO ∘
    O) for its rows (stored for the dK/dV pass: no separate preprocessing launch) and accumulates dQ over
    key tiles. L and D are contiguous (batch, heads, N_QUERIES) float32; O is read through a pointer."""
    q_start = query_tile(is_causal) * Q_TILE_SIZE
    bh = tl.program_id(1)
    off_q = head_offset(bh, H, stride_qb, stride_qh)
    off_do = head_offset(bh, H, stride_dob, stride_doh)
    q = load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D,
                   True, USE_TMA)
    do = load_rows(dO_ptr, off_do, stride_doq, stride_dod, bh, H, N_QUERIES, q_start, D, Q_TILE_SIZE,
                    BLOCK_D, True, USE_TMA)
    o = load_rows(O_ptr, head_offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES,
                   q_start, D, Q_TILE_SIZE, BLOCK_D, True, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_q = q_start + tl.arange(0, Q_TILE_SIZE)
    in_range = offs_q < N_QUERIES
    row = bh.to(tl.int64) * N_QUERIES + offs_q
    tl.store(Delta_ptr + row, delta, mask=in_range)
    lse2 = tl.load(L_ptr + row, mask=in_range, other=0.0) * LOG2E
    scale = tl.cast(scale, tl.float32)  # see flash_fwd_kernel
    qk_scale = scale * LOG2E
    off_k = head_offset(bh, H, stride_kb, stride_kh)
    off_v = head_offset(bh, H, stride_vb, stride_vh)
    dq = tl.zeros((Q_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    unmasked_end, masked_end = loop_bounds(q_start, N_KEYS, Q_TILE_SIZE, K_TILE_SIZE, is_causal)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                  stride_vd, bh, H, offs_q, 0, unmasked_end, N_KEYS, qk_scale, D, K_TILE_SIZE, BLOCK_D, False,
                  is_causal, USE_TMA)
    dq = _dq_loop(dq, q, do, lse2, delta, K_ptr, V_ptr, off_k, stride_kk, stride_kd, off_v, stride_vk,
                  stride_vd, bh, H, offs_q, unmasked_end, masked_end, N_KEYS, qk_scale, D, K_TILE_SIZE,
                  BLOCK_D, True, is_causal, USE_TMA)
    store_rows(dQ_ptr, dq * scale, head_offset(bh, H, stride_dqb, stride_dqh), stride_dqq, stride_dqd, bh, H,
                N_QUERIES, q_start, D, Q_TILE_SIZE, BLOCK_D, USE_TMA)


@triton.jit
def _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq, stride_qd, off_do,
               stride_doq, stride_dod, bh, H, offs_k, lo, hi, N_QUERIES, qk_scale, D: tl.constexpr,
               Q_TILE_SIZE: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Accumulate dK, dV of one key tile over query tiles [lo, hi), on transposed (keys x queries) tiles
    so that both accumulate without transposes. Rows past the end load as zeros (Q, dO, L, D): their P is
    finite and they add nothing (dO = 0, D = 0)."""
    row_base = bh.to(tl.int64) * N_QUERIES
    for start_q in range(lo, hi, Q_TILE_SIZE):
        offs_q = start_q + tl.arange(0, Q_TILE_SIZE)
        q = load_rows(Q_ptr, off_q, stride_qq, stride_qd, bh, H, N_QUERIES, start_q, D, Q_TILE_SIZE,
                       BLOCK_D, True, USE_TMA)
        do = load_rows(dO_ptr, off_do, stride_doq, stride_dod, bh, H, N_QUERIES, start_q, D, Q_TILE_SIZE,
                        BLOCK_D, True, USE_TMA)
        in_range = offs_q < N_QUERIES
        lse2 = tl.load(L_ptr + row_base + offs_q, mask=in_range, other=0.0) * LOG2E
        delta = tl.load(Delta_ptr + row_base + offs_q, mask=in_range, other=0.0)
        s_t = dot_f32(k, tl.trans(q))
        if MASKED:
            # exp(s - 1e6 - L) is exactly 0 in float32: -inf before exp2 gives that 0 without the bias
            # (and without overflow where a masked raw score exceeds L).
            keep = offs_q[None, :] >= offs_k[:, None]
            p_t = tl.exp2(tl.where(keep, s_t * qk_scale - lse2[None, :], float("-inf")))
        else:
            p_t = tl.exp2(s_t * qk_scale - lse2[None, :])
        dv = dot_f32(p_t.to(do.dtype), do, dv)
        dp_t = dot_f32(v, tl.trans(do))
        ds_t = p_t * (dp_t - delta[None, :])
        dk = dot_f32(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q_ptr, K_ptr, V_ptr, dO_ptr, L_ptr, Delta_ptr, dK_ptr, dV_ptr,
    stride_qb, stride_qh, stride_qq, stride_qd,
    stride_kb, stride_kh, stride_kk, stride_kd,
    stride_vb, stride_vh, stride_vk, stride_vd,
    stride_dob, stride_doh, stride_doq, stride_dod,
    stride_dkb, stride_dkh, stride_dkk, stride_dkd,
    stride_dvb, stride_dvh, stride_dvk, stride_dvd,
    H, N_QUERIES, N_KEYS,
    scale,
    D: tl.constexpr,
    Q_TILE_SIZE: tl.constexpr,
    K_TILE_SIZE: tl.constexpr,
    is_causal: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_TMA: tl.constexpr = False,
):
    """Second backward pass: one program per key tile (grid (T_k, batch * heads)) accumulates dK and dV
    over query tiles, reading the D that the dQ pass stored."""
    bh = tl.program_id(1)
    k_start = tl.program_id(0) * K_TILE_SIZE  # causal: low key tiles see the most queries and come first
    k = load_rows(K_ptr, head_offset(bh, H, stride_kb, stride_kh), stride_kk, stride_kd, bh, H, N_KEYS, k_start,
                   D, K_TILE_SIZE, BLOCK_D, True, USE_TMA)
    v = load_rows(V_ptr, head_offset(bh, H, stride_vb, stride_vh), stride_vk, stride_vd, bh, H, N_KEYS, k_start,
                   D, K_TILE_SIZE, BLOCK_D, True, USE_TMA)
    off_q = head_offset(bh, H, stride_qb, stride_qh)
    off_do = head_offset(bh, H, stride_dob, stride_doh)
    offs_k = k_start + tl.arange(0, K_TILE_SIZE)
    scale = tl.cast(scale, tl.float32)  # see flash_fwd_kernel
    qk_scale = scale * LOG2E
    dk = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    dv = tl.zeros((K_TILE_SIZE, BLOCK_D), dtype=tl.float32)
    if is_causal:
        # Query tiles before k_start see none of these keys, [k_start, k_start + K_TILE_SIZE) straddle the
        # diagonal, all later ones see every key of the tile.
        diag_end = tl.minimum(k_start + K_TILE_SIZE, N_QUERIES)
        dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq,
                            stride_qd, off_do, stride_doq, stride_dod, bh, H, offs_k, k_start, diag_end,
                            N_QUERIES, qk_scale, D, Q_TILE_SIZE, BLOCK_D, True, USE_TMA)
        lo = k_start + K_TILE_SIZE
    else:
        lo = 0
    dk, dv = _dkdv_loop(dk, dv, k, v, Q_ptr, dO_ptr, L_ptr, Delta_ptr, off_q, stride_qq, stride_qd,
                        off_do, stride_doq, stride_dod, bh, H, offs_k, lo, N_QUERIES, N_QUERIES, qk_scale, D,
                        Q_TILE_SIZE, BLOCK_D, False, USE_TMA)
    store_rows(dK_ptr, dk * scale, head_offset(bh, H, stride_dkb, stride_dkh), stride_dkk, stride_dkd, bh, H,
                N_KEYS, k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)
    store_rows(dV_ptr, dv, head_offset(bh, H, stride_dvb, stride_dvh), stride_dvk, stride_dvd, bh, H, N_KEYS,
                k_start, D, K_TILE_SIZE, BLOCK_D, USE_TMA)



@triton.jit
def flash_bwd_delta_kernel(
    O_ptr, dO_ptr, Delta_ptr, dQ_acc_ptr,
    stride_ob, stride_oh, stride_oq, stride_od,
    stride_dob, stride_doh, stride_doq, stride_dod,
    H, N_QUERIES,
    D: tl.constexpr,
    ROWS: tl.constexpr,
):
    """What the one-pass backward needs first, for ROWS query rows (grid (N_QUERIES / ROWS, batch *
    heads)): D = rowsum(dO ∘ O) into ``Delta`` ((batch, heads, N) float32), and zeros into the same rows of
    the float32 dQ accumulator (head-major rows [batch * heads * N, D]), which the one-pass kernel adds
    into. One launch: both are memory-bound and the accumulator has no other writer before it."""
    bh = tl.program_id(1)
    start = tl.program_id(0) * ROWS
    o = load_rows(O_ptr, head_offset(bh, H, stride_ob, stride_oh), stride_oq, stride_od, bh, H, N_QUERIES,
                  start, D, ROWS, D, False, False)
    do = load_rows(dO_ptr, head_offset(bh, H, stride_dob, stride_doh), stride_doq, stride_dod, bh, H, N_QUERIES,
                   start, D, ROWS, D, False, False)
    rows = bh.to(tl.int64) * N_QUERIES + start + tl.arange(0, ROWS)
    tl.store(Delta_ptr + rows, tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1))
    tl.store(dQ_acc_ptr + rows[:, None] * D + tl.arange(0, D)[None, :], tl.zeros((ROWS, D), tl.float32))

# fmt: on
