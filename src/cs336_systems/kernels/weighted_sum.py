"""D8: the handout's Triton weighted-sum example (section 1.3.1), forward and backward.

``weighted_sum(x, w) == (w * x).sum(-1)`` for x of shape (..., D) and w of shape (D,). Each program
instance owns a tile of rows; the forward walks the row tile along D with block pointers, the backward
writes grad_x directly and a per-row-tile partial grad_w that the host reduces with one ``sum`` (no
atomics between program instances).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated, so what counts is its value at import time.
INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def weighted_sum_fwd(
    x_ptr,
    weight_ptr,
    output_ptr,
    x_stride_row,
    x_stride_dim,
    weight_stride_dim,
    output_stride_row,
    ROWS,
    D,
    ROWS_TILE_SIZE: tl.constexpr,
    D_TILE_SIZE: tl.constexpr,
):
    row_tile_idx = tl.program_id(0)
    x_block_ptr = tl.make_block_ptr(
        x_ptr,
        shape=(ROWS, D),
        strides=(x_stride_row, x_stride_dim),
        offsets=(row_tile_idx * ROWS_TILE_SIZE, 0),
        block_shape=(ROWS_TILE_SIZE, D_TILE_SIZE),
        order=(1, 0),
    )
    weight_block_ptr = tl.make_block_ptr(
        weight_ptr,
        shape=(D,),
        strides=(weight_stride_dim,),
        offsets=(0,),
        block_shape=(D_TILE_SIZE,),
        order=(0,),
    )
    output_block_ptr = tl.make_block_ptr(
        output_ptr,
        shape=(ROWS,),
        strides=(output_stride_row,),
        offsets=(row_tile_idx * ROWS_TILE_SIZE,),
        block_shape=(ROWS_TILE_SIZE,),
        order=(0,),
    )
    output = tl.zeros((ROWS_TILE_SIZE,), dtype=tl.float32)
    for _ in range(tl.cdiv(D, D_TILE_SIZE)):
        # Neither tile size has to divide its extent: out-of-range elements load as zero.
        row = tl.load(x_block_ptr, boundary_check=(0, 1), padding_option="zero")
        weight = tl.load(weight_block_ptr, boundary_check=(0,), padding_option="zero")
        output += tl.sum(row.to(tl.float32) * weight.to(tl.float32)[None, :], axis=1)
        x_block_ptr = x_block_ptr.advance((0, D_TILE_SIZE))
        weight_block_ptr = weight_block_ptr.advance((D_TILE_SIZE,))
    tl.store(output_block_ptr, output.to(output_block_ptr.type.element_ty), boundary_check=(0,))


@triton.jit
def weighted_sum_backward(
    x_ptr,
    weight_ptr,
    grad_output_ptr,
    grad_x_ptr,
    partial_grad_weight_ptr,
    stride_xr,
    stride_xd,
    stride_wd,
    stride_gr,
    stride_gxr,
    stride_gxd,
    stride_gwb,
    stride_gwd,
    NUM_ROWS,
    D,
    ROWS_TILE_SIZE: tl.constexpr,
    D_TILE_SIZE: tl.constexpr,
):
    row_tile_idx = tl.program_id(0)
    n_row_tiles = tl.num_programs(0)
    grad_output_block_ptr = tl.make_block_ptr(
        grad_output_ptr,
        shape=(NUM_ROWS,),
        strides=(stride_gr,),
        offsets=(row_tile_idx * ROWS_TILE_SIZE,),
        block_shape=(ROWS_TILE_SIZE,),
        order=(0,),
    )
    x_block_ptr = tl.make_block_ptr(
        x_ptr,
        shape=(NUM_ROWS, D),
        strides=(stride_xr, stride_xd),
        offsets=(row_tile_idx * ROWS_TILE_SIZE, 0),
        block_shape=(ROWS_TILE_SIZE, D_TILE_SIZE),
        order=(1, 0),
    )
    weight_block_ptr = tl.make_block_ptr(
        weight_ptr, shape=(D,), strides=(stride_wd,), offsets=(0,), block_shape=(D_TILE_SIZE,), order=(0,)
    )
    grad_x_block_ptr = tl.make_block_ptr(
        grad_x_ptr,
        shape=(NUM_ROWS, D),
        strides=(stride_gxr, stride_gxd),
        offsets=(row_tile_idx * ROWS_TILE_SIZE, 0),
        block_shape=(ROWS_TILE_SIZE, D_TILE_SIZE),
        order=(1, 0),
    )
    partial_grad_weight_block_ptr = tl.make_block_ptr(
        partial_grad_weight_ptr,
        shape=(n_row_tiles, D),
        strides=(stride_gwb, stride_gwd),
        offsets=(row_tile_idx, 0),
        block_shape=(1, D_TILE_SIZE),
        order=(1, 0),
    )
    # The row tile of grad_output is the same for every step along D: load it once.
    grad_output = tl.load(grad_output_block_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
    for _ in range(tl.cdiv(D, D_TILE_SIZE)):
        # grad_x = grad_output ⊗ w (eq. 2)
        weight = tl.load(weight_block_ptr, boundary_check=(0,), padding_option="zero").to(tl.float32)
        grad_x_row = grad_output[:, None] * weight[None, :]
        tl.store(grad_x_block_ptr, grad_x_row.to(grad_x_block_ptr.type.element_ty), boundary_check=(0, 1))
        # grad_w (eq. 3), reduced over this tile's rows only; the host sums the row tiles.
        row = tl.load(x_block_ptr, boundary_check=(0, 1), padding_option="zero").to(tl.float32)
        grad_weight_row = tl.sum(row * grad_output[:, None], axis=0, keep_dims=True)
        tl.store(
            partial_grad_weight_block_ptr,
            grad_weight_row.to(partial_grad_weight_block_ptr.type.element_ty),
            boundary_check=(1,),
        )
        x_block_ptr = x_block_ptr.advance((0, D_TILE_SIZE))
        weight_block_ptr = weight_block_ptr.advance((D_TILE_SIZE,))
        partial_grad_weight_block_ptr = partial_grad_weight_block_ptr.advance((0, D_TILE_SIZE))
        grad_x_block_ptr = grad_x_block_ptr.advance((0, D_TILE_SIZE))


def _check_inputs(x: torch.Tensor, weight: torch.Tensor) -> None:
    if weight.ndim != 1 or x.ndim < 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(
            f"weighted_sum expects x of shape (..., D) and weight of shape (D,); got {tuple(x.shape)} "
            f"and {tuple(weight.shape)}"
        )
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device} but weight is on {weight.device}")
    if x.device.type != "cuda" and not INTERPRET:
        raise ValueError(
            f"the Triton weighted sum needs CUDA tensors (got {x.device}); set TRITON_INTERPRET=1 before "
            "importing cs336_systems to run it on the CPU"
        )
    if x.dtype != weight.dtype:
        raise TypeError(f"x is {x.dtype} but weight is {weight.dtype}")


class WeightedSumFunc(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        _check_inputs(x, weight)
        input_shape = x.shape
        D = x.shape[-1]
        x2d = x.reshape(-1, D).contiguous()
        weight = weight.contiguous()
        ctx.save_for_backward(x2d, weight)
        ctx.D_TILE_SIZE = max(triton.next_power_of_2(D) // 16, 1)  # roughly 16 steps along D
        ctx.ROWS_TILE_SIZE = 16
        ctx.input_shape = input_shape
        n_rows = x2d.shape[0]
        y = torch.empty(n_rows, device=x.device, dtype=x.dtype)
        weighted_sum_fwd[(triton.cdiv(n_rows, ctx.ROWS_TILE_SIZE),)](
            x2d,
            weight,
            y,
            x2d.stride(0),
            x2d.stride(1),
            weight.stride(0),
            y.stride(0),
            ROWS=n_rows,
            D=D,
            ROWS_TILE_SIZE=ctx.ROWS_TILE_SIZE,
            D_TILE_SIZE=ctx.D_TILE_SIZE,
        )
        return y.view(input_shape[:-1])

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        ROWS_TILE_SIZE, D_TILE_SIZE = ctx.ROWS_TILE_SIZE, ctx.D_TILE_SIZE
        n_rows, D = x.shape
        grad_out = grad_out.reshape(-1).contiguous()
        n_tiles = triton.cdiv(n_rows, ROWS_TILE_SIZE)
        # fp32 partials: the cross-tile sum below should not round at every tile.
        partial_grad_weight = torch.empty((n_tiles, D), device=x.device, dtype=torch.float32)
        grad_x = torch.empty_like(x)
        weighted_sum_backward[(n_tiles,)](
            x,
            weight,
            grad_out,
            grad_x,
            partial_grad_weight,
            x.stride(0),
            x.stride(1),
            weight.stride(0),
            grad_out.stride(0),
            grad_x.stride(0),
            grad_x.stride(1),
            partial_grad_weight.stride(0),
            partial_grad_weight.stride(1),
            NUM_ROWS=n_rows,
            D=D,
            ROWS_TILE_SIZE=ROWS_TILE_SIZE,
            D_TILE_SIZE=D_TILE_SIZE,
        )
        grad_weight = partial_grad_weight.sum(dim=0).to(weight.dtype)
        return grad_x.view(ctx.input_shape), grad_weight


def weighted_sum(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``(weight * x).sum(-1)`` through the Triton kernels, differentiable in both arguments."""
    return WeightedSumFunc.apply(x, weight)
