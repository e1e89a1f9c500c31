"""What the FlashAttention tests share: a float64 reference, relative errors, tolerances, inputs, and the
check of an implementation against the reference (O, L, dQ, dK, dV)."""

from __future__ import annotations

import math

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def reference_attention(q, k, v, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention on float64 copies, -1e6 added to masked scores; returns (O, L)."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        masked = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        s = s + torch.where(masked, -1e6, 0.0).to(s)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    assert x.shape == ref.shape, (x.shape, ref.shape)
    assert torch.isfinite(x).all(), "non-finite values (unwritten or overflowed elements)"
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def tolerance(dtype: torch.dtype, device: torch.device) -> float:
    if dtype == torch.float32:
        # tl.dot rounds fp32 operands to tf32 on the GPU; exact fp32 under the interpreter / in PyTorch.
        return 5e-3 if device.type == "cuda" else 1e-5
    return 2e-2 if dtype == torch.bfloat16 else 5e-3


def make_inputs(shape, dtype, device, generator):
    batch, n_q, n_k, d = shape
    draw = lambda *s: torch.randn(*s, generator=generator).to(device, dtype).requires_grad_()
    q, k, v = draw(batch, n_q, d), draw(batch, n_k, d), draw(batch, n_k, d)
    do = torch.randn(batch, n_q, d, generator=generator).to(device, dtype)
    return q, k, v, do


def check_against_reference(fn, q, k, v, do, is_causal: bool, tol: float) -> dict[str, float]:
    o = fn(q, k, v, is_causal)
    lse = [t for t in o.grad_fn.saved_tensors if t.shape == q.shape[:-1]]
    assert len(lse) == 1, "forward must save exactly one tensor shaped like Q.shape[:-1] (L)"
    o.backward(do)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, lse_ref = reference_attention(q64, k64, v64, is_causal)
    o_ref.backward(do.double())
    assert o.dtype == q.dtype and q.grad.dtype == q.dtype
    errors = {
        "O": rel_err(o, o_ref),
        "L": rel_err(lse[0], lse_ref),
        "dQ": rel_err(q.grad, q64.grad),
        "dK": rel_err(k.grad, k64.grad),
        "dV": rel_err(v.grad, v64.grad),
    }
    bad = {name: err for name, err in errors.items() if not err < tol}
    assert not bad, f"relative errors over {tol:g}: {bad} (all: {errors})"
    return errors
