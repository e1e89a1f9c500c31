"""fused_linear_cross_entropy against F.cross_entropy(h @ W.T) in float64: loss and both gradients, for
fp32, bf16, fp16 and autocast (fp32 h and W), mean and sum, chunks that do not divide the tokens, a vocab
that the kernel's block does not divide, logits of ±1e4, ignored rows (a whole chunk of them, and all of
them), and bad input."""

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


def _rounded(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x rounded to dtype in the forward, its gradient passed through unrounded (float64 stays exact)."""
    return x + (x.to(dtype).double() - x).detach()


def _reference(h, w, t, ignore_index=-100, reduction="mean", grad_scale=1.0, compute=None):
    """F.cross_entropy over the full logits in float64: loss and grads of the logits the kernel sees, made
    from h and W rounded to the compute dtype (h's unless given) and rounded to it again, as cuBLAS writes."""
    compute = compute or h.dtype
    h64 = h.detach().double().requires_grad_()
    w64 = w.detach().double().requires_grad_()
    logits = _rounded(_rounded(h64, compute) @ _rounded(w64, compute).T, compute)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction)
    (grad_scale * loss).backward()
    return loss.detach(), h64.grad, w64.grad


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-30)).item()


def _check(h, w, t, tol, compute=None, loss_tol=None, **kw):
    grad_scale = kw.pop("grad_scale", 1.0)
    loss = fused_linear_cross_entropy(h, w, t, **kw)
    (grad_scale * loss).backward()
    ref_loss, ref_dh, ref_dw = _reference(
        h, w, t, kw.get("ignore_index", -100), kw.get("reduction", "mean"), grad_scale, compute
    )
    assert loss.dtype == torch.float32 and loss.ndim == 0
    torch.testing.assert_close(loss.double(), ref_loss, rtol=loss_tol or tol, atol=loss_tol or tol)
    assert h.grad.dtype == h.dtype and w.grad.dtype == w.dtype
    assert _rel(h.grad, ref_dh) < tol and _rel(w.grad, ref_dw) < tol


TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 3e-3}
# dW of 256 chunks against float64: 0.0028 with an fp32 running sum, 0.0163 with a bf16 one (measured)
ACCUMULATION_BOUND = 0.006


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
    with pytest.raises(TypeError, match=r"weight must be h's dtype .* or call inside torch.autocast"):
        fused_linear_cross_entropy(h.to(torch.bfloat16), w.to(torch.float16), t)
    with torch.autocast(device.type, dtype=torch.bfloat16):  # autocast casts both: no mismatch left
        assert fused_linear_cross_entropy(h.to(torch.bfloat16), w.to(torch.float16), t).isfinite()
    with pytest.raises(ValueError, match="share a device"):
        fused_linear_cross_entropy(h, w.detach().to("meta"), t)
    with pytest.raises(TypeError, match="weight must be one of"):
        fused_linear_cross_entropy(h, w.double(), t)
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


# (h dtype, weight dtype, autocast dtype or None): the dtypes of a training loop, the kernel's compute
# dtype being autocast's when on, else h's.
PRECISIONS = {
    "autocast-bf16": (torch.float32, torch.float32, torch.bfloat16),
    "autocast-fp16": (torch.float32, torch.float32, torch.float16),
    "bf16-h-fp32-w": (torch.bfloat16, torch.float32, None),
    "fp16-h-fp32-w": (torch.float16, torch.float32, None),
    "fp16": (torch.float16, torch.float16, None),
    "fp32": (torch.float32, torch.float32, None),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_precisions_match_cross_entropy(precision, device, generator) -> None:
    h_dtype, w_dtype, autocast = PRECISIONS[precision]
    compute = autocast or h_dtype
    h, w, t = _inputs(14, 16, 45, h_dtype, device, generator, w_dtype=w_dtype)
    # The loss of the rounded logits is exact up to fp32 sums (~1e-6 here), 100x closer than the same loss
    # computed in another dtype: so a wrong compute dtype fails. cuBLAS may round a logit the other way.
    loss_tol = 2e-6 if device.type == "cpu" else TOL[compute]
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        _check(h, w, t, TOL[compute], compute=compute, loss_tol=loss_tol, chunk_tokens=5, grad_scale=2.0)
    if autocast is not None:  # and torch's own loss under the same autocast agrees
        h_ref, w_ref = h.detach().requires_grad_(), w.detach().requires_grad_()
        with torch.autocast(device.type, dtype=autocast):
            (2.0 * F.cross_entropy(h_ref @ w_ref.T, t)).backward()
        assert h_ref.grad.dtype == h.grad.dtype and w_ref.grad.dtype == w.grad.dtype
        tol = 2 * TOL[compute]
        assert _rel(h.grad, h_ref.grad.double()) < tol and _rel(w.grad, w_ref.grad.double()) < tol


class _Ctx:
    """A stand-in for autograd's ctx: calling forward and backward directly shows the dtypes the
    Function itself returns (through autograd, a wrong dtype is cast back silently)."""

    needs_input_grad = (True, True, False, False, False, False)


@pytest.mark.parametrize(
    ("h_dtype", "w_dtype", "autocast"),
    [
        (torch.float32, torch.float32, torch.bfloat16),  # fp32 h and W under bf16 autocast
        (torch.bfloat16, torch.float32, None),  # bf16 activations, fp32 master weights
        (torch.bfloat16, torch.bfloat16, None),
    ],
)
def test_backward_returns_each_gradient_in_its_inputs_dtype(
    h_dtype, w_dtype, autocast, device, generator
) -> None:
    from cs336_systems.kernels.fused_cross_entropy import FusedLinearCrossEntropy

    h, w, t = _inputs(24, 16, 40, h_dtype, device, generator, w_dtype=w_dtype)
    ctx = _Ctx()
    with torch.autocast(device.type, dtype=autocast or torch.bfloat16, enabled=autocast is not None):
        FusedLinearCrossEntropy.forward(ctx, h.detach(), w.detach(), t, -100, "mean", 8)
    dh, dw, *rest = FusedLinearCrossEntropy.backward(ctx, torch.ones((), device=device))
    assert (dh.dtype, dw.dtype) == (h_dtype, w_dtype) and rest == [None] * 4


def test_dw_accumulates_across_chunks_in_fp32(device, generator) -> None:
    """bf16 activations with fp32 master weights over 256 chunks: dW's running sum is fp32, so dW is as
    close to the float64 reference as one chunk's bf16 rounding allows. A bf16 running sum (one rounding
    per chunk) drifts several times further (measured: see the bound's comment)."""
    h, w, t = _inputs(1024, 16, 48, torch.bfloat16, device, generator, w_dtype=torch.float32)
    fused_linear_cross_entropy(h, w, t, reduction="sum", chunk_tokens=4).backward()
    _, _, ref_dw = _reference(h, w, t, reduction="sum", compute=torch.bfloat16)
    assert w.grad.dtype == torch.float32
    assert _rel(w.grad, ref_dw) < ACCUMULATION_BOUND
