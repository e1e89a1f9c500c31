"""AdamW whose step is one Triton launch over every parameter of a group.

The step is memory bound: per parameter it must read param, grad, exp_avg and exp_avg_sq (16 bytes) and
write param and both moments (12 bytes), 28 bytes in all; the xl model's 2.0e9 parameters make 56 GB,
~19 ms a step at 3 TB/s of memory bandwidth (the design's arithmetic, not a measurement). The foreach
version reads and writes the moments once per elementwise stage (8 passes); here each element is loaded once
and stored once. Measured against ``torch.optim.AdamW(fused=True)``: docs/perf-notes.md, "Memory for long
contexts", "Fused AdamW".

Multi-tensor layout: the grid runs over (tensor, block) pairs flattened into one axis. Two small device
tables say which tensor and which block of it each program takes (cached: they depend on the sizes
only); four tables of data pointers (params, grads, moments) are rebuilt each step, since gradients are
new tensors after ``zero_grad(set_to_none=True)``. Full blocks take an unmasked path and, when every
tensor is 16-byte aligned, a hint makes the loads and stores 16 bytes wide; the last block of each
tensor is masked.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from cs336_systems.adamw_base import AdamWBase
from cs336_systems.kernels.checks import INTERPRET, require_triton_device

BLOCK = 1024 if INTERPRET else 4096


# fmt: off
@triton.jit
def _adamw_kernel(
    param_ptrs, grad_ptrs, exp_avg_ptrs, exp_avg_sq_ptrs, numels, block_tensor, block_index,
    lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr, ALIGNED: tl.constexpr,
):
    pid = tl.program_id(0)
    t = tl.load(block_tensor + pid)
    start = tl.load(block_index + pid).to(tl.int64) * BLOCK
    n = tl.load(numels + t)
    p_ptr = tl.load(param_ptrs + t).to(tl.pointer_type(tl.float32))
    g_ptr = tl.load(grad_ptrs + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(exp_avg_ptrs + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(exp_avg_sq_ptrs + t).to(tl.pointer_type(tl.float32))
    if ALIGNED:
        p_ptr = tl.multiple_of(p_ptr, 16)
        g_ptr = tl.multiple_of(g_ptr, 16)
        m_ptr = tl.multiple_of(m_ptr, 16)
        v_ptr = tl.multiple_of(v_ptr, 16)
    offs = start + tl.arange(0, BLOCK)
    if start + BLOCK <= n:  # full block: no mask, so the loads can be vectorized
        p = tl.load(p_ptr + offs)
        g = tl.load(g_ptr + offs)
        m = tl.load(m_ptr + offs)
        v = tl.load(v_ptr + offs)
        p, m, v = _adamw_update(p, g, m, v, lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt)
        tl.store(p_ptr + offs, p)
        tl.store(m_ptr + offs, m)
        tl.store(v_ptr + offs, v)
    else:
        mask = offs < n
        p = tl.load(p_ptr + offs, mask=mask)
        g = tl.load(g_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        p, m, v = _adamw_update(p, g, m, v, lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)


@triton.jit
def _adamw_update(p, g, m, v, lr, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt):
    # torch.optim.AdamW's order of operations: decay, lerp of m, v, then p -= step_size * m / denom.
    p = p * decay
    m = m + (1.0 - beta1) * (g - m)
    v = v * beta2 + (1.0 - beta2) * g * g
    denom = tl.sqrt(v) / bias_correction2_sqrt + eps
    p = p - step_size * (m / denom)
    return p, m, v
# fmt: on


_BLOCK_TABLES: dict[tuple, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}


def _block_tables(numels: tuple[int, ...], device: torch.device) -> tuple[torch.Tensor, ...]:
    """(numels, block -> tensor, block -> index within its tensor) on the device, cached per layout."""
    key = (numels, str(device))
    if key not in _BLOCK_TABLES:
        counts = torch.tensor([triton.cdiv(n, BLOCK) for n in numels])
        tensor_of_block = torch.repeat_interleave(torch.arange(len(numels)), counts)
        first_block = torch.cumsum(counts, 0) - counts
        index_in_tensor = torch.arange(int(counts.sum())) - first_block[tensor_of_block]
        _BLOCK_TABLES[key] = (
            torch.tensor(numels, dtype=torch.int64).to(device),
            tensor_of_block.to(torch.int32).to(device),
            index_in_tensor.to(torch.int32).to(device),
        )
    return _BLOCK_TABLES[key]


def fused_adamw_step_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    step: int,
) -> None:
    """One AdamW update, in place, of float32 contiguous tensors on one device (one kernel launch)."""
    if not params:
        return
    numels = tuple(p.numel() for p in params)
    tables = _block_tables(numels, params[0].device)
    pointers = [[t.data_ptr() for t in ts] for ts in (params, grads, exp_avgs, exp_avg_sqs)]
    aligned = all(ptr % 16 == 0 for ts in pointers for ptr in ts)
    ptr_table = torch.tensor(pointers, dtype=torch.int64).to(params[0].device, non_blocking=True)
    bias_correction1 = 1.0 - beta1**step
    bias_correction2 = 1.0 - beta2**step
    grid = (tables[1].numel(),)
    _adamw_kernel[grid](
        ptr_table[0], ptr_table[1], ptr_table[2], ptr_table[3], *tables,
        lr, beta1, beta2, eps, 1.0 - lr * weight_decay, lr / bias_correction1, math.sqrt(bias_correction2),
        BLOCK=BLOCK, ALIGNED=aligned, num_warps=8,
    )  # fmt: skip


class FusedAdamW(AdamWBase):
    """``torch.optim.AdamW`` (no amsgrad, no maximize) with float32 parameters and state, one Triton
    launch per parameter group and step. Works on any plain float32 parameters, FSDP shards included."""

    def _check_param(self, p: torch.Tensor, group_params: list[torch.Tensor]) -> None:
        _check_param(p, group_params[0].device)

    def _update(self, params: list[torch.Tensor], step: int, group: dict) -> None:
        beta1, beta2 = group["betas"]
        fused_adamw_step_(
            params,
            [p.grad for p in params],
            [self.state[p]["exp_avg"] for p in params],
            [self.state[p]["exp_avg_sq"] for p in params],
            lr=group["lr"],
            beta1=beta1,
            beta2=beta2,
            eps=group["eps"],
            weight_decay=group["weight_decay"],
            step=step,
        )


def _check_param(p: torch.Tensor, device: torch.device) -> None:
    require_triton_device(p.device, "FusedAdamW")
    if p.device != device:
        raise ValueError(
            f"FusedAdamW: all parameters of a group must share a device; got {p.device} and {device}"
        )
    if p.dtype != torch.float32 or p.grad.dtype != torch.float32:
        raise TypeError(
            f"FusedAdamW keeps float32 parameters; got a {p.dtype} parameter with a {p.grad.dtype} grad"
        )
    if p.grad.is_sparse:
        raise TypeError("FusedAdamW does not support sparse gradients")
    if not (p.is_contiguous() and p.grad.is_contiguous()):
        raise ValueError(f"FusedAdamW needs contiguous parameters and gradients (shape {tuple(p.shape)})")
