"""Contract of the two FlashAttention hooks (``get_flashattention_autograd_function_pytorch`` and
``_triton``): ``apply(Q, K, V, is_causal)`` on (batch, seq, d) inputs, compared with float64 math.

Checked per case: the output; exactly one saved tensor of shape (batch, n_queries), the logsumexp L,
against float64; dQ, dK, dV against float64 autograd. Sequence lengths are chosen so that no tile
size divides them, n_queries != n_keys both ways, causal (top-left aligned, masked scores get -1e6)
and not, fp32 and bf16. Tolerances are ``atol + rtol·|ref|`` with atol = rtol = 1e-2 in fp32 (the
course's, loose enough for TF32 matmuls on a GPU) and 5e-2 in bf16 (inputs and P rounded to 8 bits).

Bad input (mismatched head dims, key counts or batch sizes) must raise an exception, within the
test's timeout: returning a tensor computed from mismatched shapes is the silent failure graders
cannot see. Any exception type is accepted (an assert, a ValueError, torch's own RuntimeError).

On a CPU-only machine the Triton hook runs under ``TRITON_INTERPRET=1`` with small shapes; the
``gpu`` cases repeat the checks at lengths of a few thousand.
"""

from __future__ import annotations

import math

import pytest
import torch

from .contract import Hooks, assert_no_misses, miss, skip_blank

KINDS = ("pytorch", "triton")
TOL = {torch.float32: 1e-2, torch.bfloat16: 5e-2}
DTYPE_NAME = {torch.float32: "fp32", torch.bfloat16: "bf16"}
D = 16
CPU_SHAPES = ((2, 37, 37), (2, 45, 83), (2, 83, 45))  # (batch, n_q, n_k): primes-ish, no tile divides
GPU_SHAPES = ((2, 1000, 1537, 64), (1, 3001, 2049, 128), (4, 4097, 4097, 64))


def _kind_param(kind: str):
    return pytest.param(kind, marks=pytest.mark.hook(f"get_flashattention_autograd_function_{kind}"), id=kind)


def reference(q, k, v, is_causal: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Float64 attention and its logsumexp L (masked scores get -1e6, the handout's convention)."""
    s = q.double() @ k.double().transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        masked = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        s = s + masked * -1e6
    return torch.softmax(s, dim=-1) @ v.double(), torch.logsumexp(s, dim=-1)


def check_case(fn: type, shape: tuple, is_causal: bool, dtype: torch.dtype, device: torch.device) -> None:
    batch, n_q, n_k, d = (*shape, D)[:4]
    gen = torch.Generator().manual_seed(n_q * 1000 + n_k)
    q, k, v = (torch.randn(batch, n, d, generator=gen) for n in (n_q, n_k, n_k))
    d_out = torch.randn(batch, n_q, d, generator=gen)
    q, k, v = (t.to(device, dtype).requires_grad_() for t in (q, k, v))
    where = f"{'causal' if is_causal else 'not causal'}, {DTYPE_NAME[dtype]}, batch={batch}, n_q={n_q}, n_k={n_k}, d={d}"
    out = fn.apply(q, k, v, is_causal)
    saved = getattr(out.grad_fn, "saved_tensors", ())
    logsumexps = [t for t in saved if tuple(t.shape) == (batch, n_q)]
    out.backward(d_out.to(device, dtype))

    ref_inputs = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_out, ref_l = reference(*ref_inputs, is_causal)
    ref_out.backward(d_out.to(device).double())
    tol = TOL[dtype]
    misses = [miss("O", out, ref_out, tol, tol, where)]
    if len(logsumexps) != 1:
        shapes = [tuple(t.shape) for t in saved]
        misses.append(
            f"saved L: expected exactly one saved tensor of shape {(batch, n_q)}, found "
            f"{len(logsumexps)} among the saved tensors {shapes} ({where})"
        )
    else:
        misses.append(miss("L", logsumexps[0], ref_l, tol, tol, where))
    for name, t, ref in zip(("dQ", "dK", "dV"), (q, k, v), ref_inputs, strict=True):
        if t.grad is None:
            misses.append(f"{name}: no gradient reached the input ({where})")
        else:
            misses.append(miss(name, t.grad, ref.grad, tol, tol, where))
    assert_no_misses(misses)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", CPU_SHAPES, ids=lambda s: f"b{s[0]}-q{s[1]}-k{s[2]}")
@pytest.mark.parametrize("kind", [_kind_param(k) for k in KINDS])
def test_matches_float64(
    hooks: Hooks, device: torch.device, kind: str, shape: tuple, is_causal: bool, dtype: torch.dtype
) -> None:
    """O, the saved L, dQ, dK and dV against float64 math, on lengths no tile size divides (on the
    GPU when there is one, else on the CPU: Triton under its interpreter)."""
    fn = skip_blank(getattr(hooks, f"get_flashattention_autograd_function_{kind}"))
    check_case(fn, shape, is_causal, dtype, device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", GPU_SHAPES, ids=lambda s: f"b{s[0]}-q{s[1]}-k{s[2]}-d{s[3]}")
@pytest.mark.parametrize("kind", [_kind_param(k) for k in KINDS])
def test_matches_float64_gpu(
    hooks: Hooks, kind: str, shape: tuple, is_causal: bool, dtype: torch.dtype
) -> None:
    """The same checks on a GPU at lengths of a few thousand (d 64 and 128)."""
    fn = skip_blank(getattr(hooks, f"get_flashattention_autograd_function_{kind}"))
    check_case(fn, shape, is_causal, dtype, torch.device("cuda"))


BAD_INPUTS = {
    "head-dims-differ": ((2, 33, 16), (2, 33, 32), (2, 33, 32)),
    "k-v-lengths-differ": ((2, 33, 16), (2, 33, 16), (2, 40, 16)),
    "batch-sizes-differ": ((2, 33, 16), (3, 33, 16), (3, 33, 16)),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", BAD_INPUTS)
@pytest.mark.parametrize("kind", [_kind_param(k) for k in KINDS])
def test_bad_input_raises(hooks: Hooks, device: torch.device, kind: str, bad: str) -> None:
    """Mismatched shapes raise an exception (of any type), and do so promptly, instead of returning."""
    fn = skip_blank(getattr(hooks, f"get_flashattention_autograd_function_{kind}"))
    q, k, v = (torch.randn(s, device=device) for s in BAD_INPUTS[bad])
    shapes = f"Q {tuple(q.shape)}, K {tuple(k.shape)}, V {tuple(v.shape)}"
    try:
        out = fn.apply(q, k, v, False)
    except Exception as exc:
        assert str(exc).strip(), f"bad input ({bad}: {shapes}) raised {type(exc).__name__} with no message"
        return
    pytest.fail(
        f"bad input is not refused: {bad} ({shapes}) returned a tensor of shape {tuple(out.shape)} "
        "instead of raising"
    )
