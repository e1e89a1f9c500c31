"""Tile loads and stores, the float32 dot and the loop bounds shared by the Triton kernels of FlashAttention-2
(``triton_fwd``, ``triton_bwd``).

Tensors are (batch, heads, seq, d) of any strides; a kernel's program handles one tile of one (batch,
head) = divmod(program_id(1), heads). Scores are kept in log2 units (exp2, with 1/sqrt(d)·log2(e) folded
into one multiply). Rows past the end read as zeros; head dims that are not powers of two are padded to
the next one (zeros do not change dot products). A tile moves through a tensor descriptor (Hopper's copy
engine, ``USE_TMA``) or a block pointer.
"""

import triton
import triton.language as tl

from .settings import INTERPRET

# Globals read inside kernels must be constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
MASK_BIAS = tl.constexpr(-1e6)  # the handout's additive mask, in natural-log units
# The triton 3.6 interpreter multiplies bfloat16 dot operands wrongly (numpy has no bfloat16): under it,
# operands are widened to float32 first, which is exact and keeps the algorithm's roundings (P, dS casts).
_WIDEN_DOTS = tl.constexpr(INTERPRET)


# Kernels keep the Triton tutorials' dense layout of long argument lists.
# fmt: off
@triton.jit
def head_offset(bh, H, stride_b, stride_h):
    """Element offset of head (b, h) = divmod(bh, H) of a (batch, heads, N, D) tensor, in int64."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return b * stride_b + h * stride_h


@triton.jit
def load_rows(X, off, stride_n, stride_d, bh, H, N, start, D: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """Rows [start, start + ROWS) of head bh of a (batch, heads, N, D) tensor as a (ROWS, BLOCK_D) tile.
    Rows past N and head-dim padding read as zeros. X is a 4-D tensor descriptor (TMA: bounds checked by
    the copy engine) or a pointer (block pointer at element offset ``off``, bounds checked where asked)."""
    if USE_TMA:
        x = X.load([bh // H, bh % H, start, 0]).reshape(ROWS, BLOCK_D)
    else:
        ptr = tl.make_block_ptr(X + off, shape=(N, D), strides=(stride_n, stride_d), offsets=(start, 0),
                                block_shape=(ROWS, BLOCK_D), order=(1, 0))
        if D == BLOCK_D:
            if CHECK_ROWS:  # noqa: SIM108
                x = tl.load(ptr, boundary_check=(0,), padding_option="zero")
            else:
                x = tl.load(ptr)
        else:
            x = tl.load(ptr, boundary_check=(0, 1), padding_option="zero")
    return x


@triton.jit
def store_rows(X, x, off, stride_n, stride_d, bh, H, N, start, D: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Store a (ROWS, BLOCK_D) tile at rows [start, start + ROWS) of head bh, dropping out-of-range parts."""
    if USE_TMA:
        X.store([bh // H, bh % H, start, 0], x.to(X.dtype).reshape(1, 1, ROWS, BLOCK_D))
    else:
        ptr = tl.make_block_ptr(X + off, shape=(N, D), strides=(stride_n, stride_d), offsets=(start, 0),
                                block_shape=(ROWS, BLOCK_D), order=(1, 0))
        tl.store(ptr, x.to(ptr.type.element_ty), boundary_check=(0, 1))


@triton.jit
def dot_f32(a, b, acc=None):
    """tl.dot with a float32 result (accumulated into ``acc`` when given)."""
    if _WIDEN_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc=acc, out_dtype=tl.float32)


@triton.jit
def loop_bounds(tile_start, N_OTHER, TILE: tl.constexpr, STEP: tl.constexpr, is_causal: tl.constexpr):
    """For a query tile [tile_start, tile_start + TILE) that loops over keys in steps of STEP: the end of
    the steps that need no mask at all, and the end of the masked ones (diagonal tiles, ragged last tile).
    Key tiles past the diagonal are never visited (they would only add exp(-1e6) = 0)."""
    full_end = (N_OTHER // STEP) * STEP
    if is_causal:
        unmasked_end = tl.minimum(tile_start, full_end)
        masked_end = tl.minimum(tile_start + TILE, N_OTHER)
    else:
        unmasked_end = full_end
        masked_end = N_OTHER
    return unmasked_end, masked_end


@triton.jit
def query_tile(is_causal: tl.constexpr):
    """Query tile of this program: with causal masking the work grows with the query index, so the
    heaviest tiles are launched first and the tail of the grid is short."""
    if is_causal:  # noqa: SIM108
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
    else:
        tile = tl.program_id(0)
    return tile


# ----------------------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------------------
# fmt: on
