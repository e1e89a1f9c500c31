"""Fused LM head + cross-entropy: the loss of ``h @ W.T`` without ever holding all the logits.

The full logits of a long-context step are huge (32k tokens x 151,936 vocab = 10 GB in bf16, and as much
again for their gradient). Here the tokens go through in chunks; for each chunk

    logits = h_c @ W.T                      (cuBLAS, one chunk of logits alive)
    loss_c, logits <- softmax - onehot      (Triton: lse and loss, then the logit gradient in place)
    dh_c = dlogits @ W ;  dW += dlogits.T @ h_c      (cuBLAS)

so the forward already produces the gradients of h and W (Liger-Kernel's structure): the logits are
computed once, and backward only scales the stored gradients by grad_output. Without a gradient to
compute (no_grad, or neither input requires one) only the loss is computed.

Precision: the softmax, the log-sum-exp and the loss run in float32 whatever the input dtype; each GEMM
accumulates in float32 (cuBLAS). dW accumulates across chunks in the weight's dtype: float32 for fp32
weights, including fp32 master weights with bf16 activations (mixed precision, see below); for bf16
weights the running sum is bf16 (one rounding per chunk), as an fp32 copy of dW would cost 2 bytes x V x d
more than the whole chunk of logits.

Compute dtype (that of the GEMMs and of the stored logits): inside ``torch.autocast`` for h's device, the
autocast dtype, as autocast would choose for ``h @ W.T`` (fp32 h and W are cast chunk by chunk, W once);
outside it, h's dtype, so bf16/fp16 ``h`` with fp32 master ``weight`` runs bf16/fp16 GEMMs. Each gradient
comes back in its input's dtype (fp32 dh and dW for fp32 h and W under autocast).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from cs336_systems.kernels.checks import INTERPRET, require_triton_device

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Default chunk: as many tokens as keep one chunk of logits within this many bytes (a power of two of
# tokens, at least MIN_CHUNK). 512 MiB: ~1k tokens at vocab 151,936 in bf16, where every GEMM is still
# compute bound (the dW GEMM's arithmetic intensity is ~chunk/2 FLOP per byte of dW read and written).
CHUNK_BYTES = 1 << 29
MIN_CHUNK = 128


# fmt: off
@triton.jit
def _cross_entropy_rows_kernel(
    logits_ptr, stride_row, targets_ptr, loss_ptr, scale_ptr, V, ignore_index,
    BLOCK_V: tl.constexpr, WRITE_GRAD: tl.constexpr,
):
    """One row of logits per program: loss = lse - logit[target] (0 where ignored); with WRITE_GRAD the
    row is overwritten by d(scale * loss)/d(logits) = (softmax - onehot) * scale (zeros where ignored)."""
    DTYPE = logits_ptr.dtype.element_ty
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_row
    target = tl.load(targets_ptr + row).to(tl.int64)
    ignored = target == ignore_index
    cols = tl.arange(0, BLOCK_V)
    # Pass 1: online max and sum of exp in float32 (logits of 1e4 neither overflow nor lose the target).
    # Full blocks load without a mask (so 16-byte wide), the ragged last block with one.
    v_full = (V // BLOCK_V) * BLOCK_V
    m = float("-inf")
    s = 0.0
    for start in range(0, v_full, BLOCK_V):
        x = tl.load(row_ptr + start + cols).to(tl.float32)
        m, s = _online_lse(m, s, x)
    if v_full < V:
        x = tl.load(row_ptr + v_full + cols, mask=v_full + cols < V, other=float("-inf")).to(tl.float32)
        m, s = _online_lse(m, s, x)
    lse = m + tl.log(s)
    safe_target = tl.where(ignored, 0, target)
    target_logit = tl.load(row_ptr + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(ignored, 0.0, lse - target_logit))
    if WRITE_GRAD:
        scale = tl.where(ignored, 0.0, tl.load(scale_ptr))
        for start in range(0, v_full, BLOCK_V):
            x = tl.load(row_ptr + start + cols).to(tl.float32)
            tl.store(row_ptr + start + cols, _logit_grad(x, start + cols, target, lse, scale).to(DTYPE))
        if v_full < V:
            offs = v_full + cols
            x = tl.load(row_ptr + offs, mask=offs < V, other=0.0).to(tl.float32)
            tl.store(row_ptr + offs, _logit_grad(x, offs, target, lse, scale).to(DTYPE), mask=offs < V)


@triton.jit
def _online_lse(m, s, x):
    m_new = tl.maximum(m, tl.max(x, axis=0))  # finite: every block holds at least one column
    s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
    return m_new, s


@triton.jit
def _logit_grad(x, cols, target, lse, scale):
    p = tl.exp(x - lse)
    return tl.where(cols == target, p - 1.0, p) * scale
# fmt: on


def _launch_rows(logits: torch.Tensor, targets: torch.Tensor, loss: torch.Tensor, scale: torch.Tensor,
                 ignore_index: int, write_grad: bool) -> None:  # fmt: skip
    rows, V = logits.shape
    block_v = min(
        triton.next_power_of_2(V), 32 if INTERPRET else 8192
    )  # small under the interpreter: tests reach the full-block loop
    _cross_entropy_rows_kernel[(rows,)](
        logits, logits.stride(0), targets, loss, scale, V, ignore_index,
        BLOCK_V=block_v, WRITE_GRAD=write_grad, num_warps=1 if INTERPRET else 16,
    )  # fmt: skip


def default_chunk_tokens(n_tokens: int, vocab: int, dtype: torch.dtype) -> int:
    per_token = vocab * torch.empty((), dtype=dtype).element_size()
    chunk = max(MIN_CHUNK, 1 << max(0, (CHUNK_BYTES // per_token).bit_length() - 1))
    return max(1, min(chunk, n_tokens))


def compute_dtype(h: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The GEMMs' dtype: autocast's for h's device when it is on (what it would pick for ``h @ W.T``),
    else h's (bf16/fp16 activations with fp32 master weights compute in the activations' dtype)."""
    device_type = h.device.type
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    if weight.dtype != h.dtype and weight.dtype != torch.float32:
        raise TypeError(
            f"weight must be h's dtype ({h.dtype}) or float32 master weights, got {weight.dtype}; "
            "cast one of them, or call inside torch.autocast to compute both in the autocast dtype"
        )
    return h.dtype


def _check_inputs(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, reduction: str,
                  chunk_tokens: int | None) -> None:  # fmt: skip
    if weight.ndim != 2 or h.ndim < 1 or h.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"fused_linear_cross_entropy expects h (..., d) and weight (vocab, d); got h {tuple(h.shape)} "
            f"and weight {tuple(weight.shape)}"
        )
    if targets.shape != h.shape[:-1]:
        raise ValueError(f"targets {tuple(targets.shape)} must have h's leading shape {tuple(h.shape[:-1])}")
    if h.device != weight.device or h.device != targets.device:
        raise ValueError(
            f"h, weight and targets must share a device; got {h.device}, {weight.device}, {targets.device}"
        )
    require_triton_device(h.device, "fused_linear_cross_entropy")
    for name, tensor in (("h", h), ("weight", weight)):
        if tensor.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{name} must be one of {FLOAT_DTYPES}, got {tensor.dtype}")
    if targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"targets must be int64 or int32 class indices, got {targets.dtype}")
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if chunk_tokens is not None and chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")


def _accumulate_dw(dw: torch.Tensor, grad_logits: torch.Tensor, h_chunk: torch.Tensor) -> None:
    """dw += grad_logits.T @ h_chunk, accumulated in dw's dtype."""
    if dw.dtype == grad_logits.dtype:
        dw.addmm_(grad_logits.t(), h_chunk)
    elif dw.dtype != torch.float32:  # e.g. bf16 weight under fp16 autocast: a rare V x d temporary
        dw.add_(grad_logits.t() @ h_chunk)
    elif dw.device.type == "cuda":
        # fp32 masters, bf16/fp16 GEMM: cuBLAS writes fp32 straight into dW (no V x d temporary).
        torch.ops.aten.addmm.dtype_out(dw, grad_logits.t(), h_chunk, dw.dtype, out=dw)
    else:  # the interpreter's CPU path (tiny sizes): widen the operands instead
        dw.addmm_(grad_logits.t().to(dw.dtype), h_chunk.to(dw.dtype))


def _chunked_loss_and_grads(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                            reduction: str, chunk_tokens: int | None, dtype: torch.dtype, want_dh: bool,
                            want_dw: bool) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:  # fmt: skip
    """The loss (fp32) and, where wanted, dh in h's dtype and dW in weight's, for grad_output 1; GEMMs
    and logits in ``dtype``."""
    d, vocab = h.shape[-1], weight.shape[0]
    h2 = h.reshape(-1, d).contiguous()
    t = targets.reshape(-1).contiguous()
    n = h2.shape[0]
    w = weight.to(dtype).contiguous()  # a no-op unless the weight is fp32 masters (or autocast casts it)
    if reduction == "mean":  # 1/n_valid on the device: no host sync; inf (loss nan) if all ignored
        scale = (1.0 / (t != ignore_index).sum().to(torch.float32)).reshape(1)
    else:
        scale = torch.ones(1, device=h.device, dtype=torch.float32)
    row_loss = torch.empty(n, device=h.device, dtype=torch.float32)
    dh = torch.empty_like(h2) if want_dh else None
    dw = torch.zeros_like(weight) if want_dw else None
    chunk = chunk_tokens or default_chunk_tokens(n, vocab, dtype)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        h_c = h2[start:end].to(dtype)  # per chunk: no full-size copy of fp32 h under autocast
        logits = h_c @ w.t()  # the one chunk of logits alive; becomes its gradient in place
        _launch_rows(logits, t[start:end], row_loss[start:end], scale, ignore_index, want_dh or want_dw)
        if want_dh:
            if dh.dtype == dtype:
                torch.mm(logits, w, out=dh[start:end])
            else:  # fp32 h under autocast: a chunk x d temporary, cast as autocast's backward would
                dh[start:end].copy_(logits @ w)
        if want_dw:
            _accumulate_dw(dw, logits, h_c)
        del logits
    return row_loss.sum() * scale[0], dh, dw


class FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int,
                reduction: str, chunk_tokens: int | None) -> torch.Tensor:  # fmt: skip
        _check_inputs(h, weight, targets, reduction, chunk_tokens)
        dtype = compute_dtype(h, weight)
        # Autocast off inside: every cast below is explicit, so `out=` buffers keep their dtypes.
        with torch.autocast(h.device.type, enabled=False):
            loss, dh, dw = _chunked_loss_and_grads(
                h, weight, targets, ignore_index, reduction, chunk_tokens, dtype,
                want_dh=ctx.needs_input_grad[0], want_dw=ctx.needs_input_grad[1],
            )  # fmt: skip
        ctx.grads = (dh.view(h.shape) if dh is not None else None, dw)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        if ctx.grads is None:  # the gradients were scaled in place by the first backward
            raise RuntimeError("fused_linear_cross_entropy: backward called twice on one forward")
        dh, dw = ctx.grads
        ctx.grads = None
        # In place: a scaled copy of dW would cost as much memory as dW itself.
        if dh is not None:
            dh.mul_(grad_output.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad_output.to(dw.dtype))
        return dh, dw, None, None, None, None


@torch.compiler.disable  # inside a compiled model the loss runs eagerly (a graph break), as written
def fused_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    ignore_index: int = -100,
    reduction: str = "mean",
    chunk_tokens: int | None = None,
) -> torch.Tensor:
    """``F.cross_entropy(h @ weight.T, targets, ignore_index=..., reduction=...)`` (a float32 scalar),
    computed over chunks of ``chunk_tokens`` tokens (default: ~512 MiB of logits per chunk).

    h: (..., d) float32/bfloat16/float16; weight: (vocab, d), h's dtype or float32 (any of the three under
    autocast); targets: (...) int. The GEMMs run in autocast's dtype when autocast is on for h's device.
    Mean over the tokens whose target is not ``ignore_index`` (nan if there are none, as torch)."""
    return FusedLinearCrossEntropy.apply(h, weight, targets, ignore_index, reduction, chunk_tokens)
