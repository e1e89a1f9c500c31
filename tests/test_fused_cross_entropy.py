"""fused_linear_cross_entropy against F.cross_entropy(h @ W.T) in float64: loss and both gradients, for
fp32 and bf16, mean and sum, chunks that do not divide the tokens, a vocab that the kernel's block does not
divide, logits of ±1e4, ignored rows (a whole chunk of them, and all of them), and bad input."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.kernels.fused_cross_entropy import default_chunk_tokens, fused_linear_cross_entropy


def _inputs(tokens, d, vocab, dtype, device, gen, w_scale=1.0, w_dtype=None):
    h = torch.randn(tokens, d, generator=gen).to(device, dtype).requires_grad_()
    w = (w_scale * torch.randn(vocab, d, generator=gen)).to(device, w_dtype or dtype).requires_grad_()
    t = torch.randint(0, vocab, (tokens,), generator=gen).to(device)
    return h, w, t


def _reference(h, w, t, ignore_index=-100, reduction="mean", grad_scale=1.0):
    """Float64 loss and grads of the same logits the kernel sees (rounded to h's dtype, as cuBLAS writes)."""
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logits = (h64 @ w64.T).to(h.dtype).double() if h.dtype != torch.float32 else h64 @ w64.T
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)
    (grad_scale * loss).backward()
    return loss.detach(), h64.grad, w64.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(h, w, t, tol, **kw):
    grad_scale = kw.pop("grad_scale", 1.0)
    loss = fused_linear_cross_entropy(h, w, t, **kw)
    (grad_scale * loss).backward()
    ref_loss, ref_dh, ref_dw = _reference(
        h, w, t, kw.get("ignore_index", -100), kw.get("reduction", "mean"), grad_scale
    )
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert _rel(h.grad, ref_dh) < tol and _rel(w.grad, ref_dw) < tol


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("chunk", [None, 5])
def test_matches_cross_entropy(dtype, reduction, chunk, device, generator) -> None:
    # 14 tokens in chunks of 5; vocab 45 = one full 32-wide block (under the interpreter) and a ragged one
    h, w, t = _inputs(14, 16, 45, dtype, device, generator)
    _check(h, w, t, TOL[dtype], reduction=reduction, chunk_tokens=chunk, grad_scale=3.0)


def test_large_logits(device, generator) -> None:
    # |logits| ~ 1e4: exp would overflow without the running max; the target logit must not be lost
    h, w, t = _inputs(12, 8, 40, torch.float32, device, generator, w_scale=4e3)
    h2 = h.detach() @ w.detach().T
    assert h2.abs().max() > 1e4
    _check(h, w, t, 1e-5, chunk_tokens=5)


def test_ignore_index(dtype, device, generator) -> None:
    h, w, t = _inputs(15, 16, 37, dtype, device, generator)
    t[5:10] = -1  # one whole chunk ignored
    t[0] = -1
    _check(h, w, t, TOL[dtype], ignore_index=-1, chunk_tokens=5)
    assert h.grad[5:10].abs().max() == 0


def test_all_ignored(device, generator) -> None:
    h, w, t = _inputs(6, 8, 20, torch.float32, device, generator)
    t.fill_(-100)
    loss = fused_linear_cross_entropy(h, w, t, reduction="sum")
    loss.backward()
    assert loss.item() == 0.0 and h.grad.abs().max() == 0 and w.grad.abs().max() == 0
    mean = fused_linear_cross_entropy(h.detach(), w.detach(), t)  # torch's mean over nothing is nan
    assert torch.isnan(mean) and torch.isnan(F.cross_entropy(h.detach() @ w.detach().T, t))


def test_batched_shape_and_mixed_precision(device, generator) -> None:
    # (batch, seq, d) activations in bf16 with fp32 master weights: fp32 dW of the bf16 GEMMs
    h, w, t = _inputs(12, 16, 33, torch.bfloat16, device, generator, w_dtype=torch.float32)
    h3 = h.detach().view(3, 4, 16).requires_grad_()
    loss = fused_linear_cross_entropy(h3, w, t.view(3, 4), chunk_tokens=5)
    loss.backward()
    w_b = w.detach().to(torch.bfloat16).requires_grad_()
    ref_loss, ref_dh, ref_dw = _reference(h.detach(), w_b, t)
    assert w.grad.dtype == torch.float32 and h3.grad.shape == (3, 4, 16)
    torch.testing.assert_close(loss.double(), ref_loss, rtol=2e-2, atol=2e-2)
    assert _rel(h3.grad.view(12, 16), ref_dh) < 2e-2 and _rel(w.grad, ref_dw) < 2e-2


def test_no_grad_computes_loss_only(device, generator) -> None:
    h, w, t = _inputs(9, 8, 30, torch.float32, device, generator)
    with torch.no_grad():
        loss = fused_linear_cross_entropy(h, w, t)
    torch.testing.assert_close(loss, F.cross_entropy(h.detach() @ w.detach().T, t), rtol=1e-5, atol=1e-5)
    assert not loss.requires_grad


def test_default_chunk() -> None:
    assert default_chunk_tokens(32768, 151_936, torch.bfloat16) == 1024  # ~297 MiB of logits
    assert default_chunk_tokens(8192, 10_000, torch.bfloat16) == 8192  # the whole batch at once
    assert default_chunk_tokens(10, 10**9, torch.float32) == 10


def test_bad_input(device, generator) -> None:
    h, w, t = _inputs(4, 8, 10, torch.float32, device, generator)
    with pytest.raises(ValueError, match="weight"):
        fused_linear_cross_entropy(h, w[:, :4], t)
    with pytest.raises(ValueError, match="targets"):
        fused_linear_cross_entropy(h, w, t[:3])
    with pytest.raises(TypeError, match="targets"):
        fused_linear_cross_entropy(h, w, t.float())
    with pytest.raises(TypeError, match="weight"):
        fused_linear_cross_entropy(h.to(torch.bfloat16), w.to(torch.float16), t)
    with pytest.raises(TypeError, match="h must be"):
        fused_linear_cross_entropy(h.to(torch.float64), w, t)
    with pytest.raises(ValueError, match="reduction"):
        fused_linear_cross_entropy(h, w, t, reduction="none")
    with pytest.raises(ValueError, match="chunk_tokens"):
        fused_linear_cross_entropy(h, w, t, chunk_tokens=0)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
def test_gpu_sizes_and_memory(dtype_name: str, generator) -> None:
    """A vocab of several 8192-wide blocks plus a ragged one, on the GPU; the loss's extra memory stays
    within a few chunks of logits (the full logits would be 4096 x 20,000)."""
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype_name]
    device = torch.device("cuda")
    h, w, t = _inputs(4096, 256, 20_000, dtype, device, generator)
    t[:100] = -100
    # Warm-up: the first cuBLAS call on a stream allocates its workspace through the caching allocator,
    # which would count as the loss's memory in a process (an xdist worker) that has not run one yet.
    fused_linear_cross_entropy(h, w, t, chunk_tokens=512).backward()
    h.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    loss = fused_linear_cross_entropy(h, w, t, chunk_tokens=512)
    extra = torch.cuda.max_memory_allocated() - base
    loss.backward()
    chunk_bytes = 512 * 20_000 * h.element_size()
    grads = h.numel() * h.element_size() + w.numel() * w.element_size()
    assert extra < grads + 2 * chunk_bytes
    ref_loss, ref_dh, ref_dw = _reference(h, w, t)
    tol = {torch.float32: 1e-3, torch.bfloat16: 2e-2}[dtype]  # tf32 may be on for fp32 GEMMs
    torch.testing.assert_close(loss.double(), ref_loss, rtol=tol, atol=tol)
    assert _rel(h.grad, ref_dh) < tol and _rel(w.grad, ref_dw) < tol
