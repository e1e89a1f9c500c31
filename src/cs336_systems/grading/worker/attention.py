"""Checks of the two FlashAttention hooks, ``apply(Q, K, V, is_causal)`` on (batch, seq, d) inputs.

Tiers (``CASES``):
- ``course``: what the course promises and tests: lengths powers of 2 of at least 16, n_queries =
  n_keys, fp32; the PyTorch hook not causal, the Triton hook both ways.
- ``leaderboard`` (Triton, GPU): bf16, causal, the 2025 leaderboard's shape, under ``torch.compile``.
- ``beyond``: lengths no tile divides, n_queries != n_keys, PyTorch causal, bf16 on the CPU, bad input.

Tolerances are relative to a same-precision reference, as FlashAttention's own tests bound them: an
output's error against float64 may be at most ``FACTOR`` times that of plain PyTorch attention computed
in the same dtype, and never needs to be below ``FLOOR`` (by dtype and device; on a GPU fp32 allows for
``tl.dot``'s default TF32) of the reference's largest value. A 1% error fails in fp32 on the CPU; honest
bf16 rounding and TF32 pass.
"""

from __future__ import annotations

import math
import traceback
from typing import Any

import torch

from . import outcome
from .hooks import HookNotImplemented, Hooks

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
FACTOR = 10.0
# Never below this share of the reference's largest value. fp32 on a GPU: Triton's tl.dot rounds fp32
# operands to TF32 (10 mantissa bits) by default, about 2e-3 of the largest value at these sizes.
FLOOR = {("fp32", "cpu"): 1e-4, ("fp32", "cuda"): 8e-3, ("bf16", "cpu"): 1e-2, ("bf16", "cuda"): 1e-2}
HOOK = {k: f"get_flashattention_autograd_function_{k}" for k in ("pytorch", "triton")}
LEADERBOARD = (16, 16384, 16384, 64)  # the 2025 leaderboard: q, k, v of (16, 16384, 64), causal, bf16


def _case(
    kind: str, tier: str, shape: tuple, causal: bool, dtype: str, check: str = "match", gpu: bool = False
) -> dict:
    b, nq, nk, d = shape
    name = f"{tier}-{kind}-{check}-b{b}-q{nq}-k{nk}-d{d}-{'causal' if causal else 'full'}-{dtype}"
    return {
        "id": name + ("-gpu" if gpu else ""),
        "kind": kind,
        "tier": tier,
        "shape": list(shape),
        "causal": causal,
        "dtype": dtype,
        "check": check,
        "gpu": gpu,
    }


def _cases() -> list[dict]:
    cases = []
    course_cpu = {
        "pytorch": ((4, 128, 128, 64), (2, 64, 64, 16)),
        "triton": ((1, 64, 64, 32), (2, 16, 16, 16)),
    }
    odd = ((2, 37, 37, 16), (2, 45, 83, 16), (2, 83, 45, 16))
    gpu_beyond = ((2, 1000, 1537, 64), (1, 3001, 2049, 128), (4, 4097, 4097, 64))
    for kind, shapes in course_cpu.items():
        course_causal = (False, True) if kind == "triton" else (False,)
        for s in shapes:
            cases += [_case(kind, "course", s, c, "fp32") for c in course_causal]
            if kind == "pytorch":
                cases.append(_case(kind, "beyond", s, True, "fp32"))
        for s in odd:
            cases += [_case(kind, "beyond", s, c, dt) for c in (False, True) for dt in ("fp32", "bf16")]
        cases += [_case(kind, "beyond", s, False, "fp32", check=bad) for s, bad in BAD_SHAPES.items()]
        # The course runs the PyTorch hook on the CPU only: on a GPU it is beyond the course.
        gpu_tier = "course" if kind == "triton" else "beyond"
        cases += [_case(kind, gpu_tier, (4, 128, 128, 64), c, "fp32", gpu=True) for c in (False, True)]
        cases += [
            _case(kind, "beyond", s, c, dt, gpu=True)
            for s in gpu_beyond
            for c in (False, True)
            for dt in DTYPES
        ]
    cases.append(_case("triton", "leaderboard", (16, 2048, 2048, 64), True, "bf16", gpu=True))
    cases.append(_case("triton", "leaderboard", LEADERBOARD, True, "bf16", check="compile", gpu=True))
    return cases


BAD_SHAPES = {  # (Q, K, V) shapes -> what is wrong with them
    (2, 33, 33, 16): "bad-head-dims",
    (2, 33, 40, 16): "bad-kv-lengths",
    (3, 33, 33, 16): "bad-batch-sizes",
}
CASES = {c["id"]: c for c in _cases()}


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention in the inputs' dtype and its logsumexp (masked scores get -1e6, the handout's
    convention): the float64 reference when given float64 inputs, the same-precision one otherwise."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        masked = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        s = s + (masked * -1e6).to(s.dtype)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def _run_reference(inputs: list[torch.Tensor], d_out: torch.Tensor, causal: bool, dtype: torch.dtype) -> dict:
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = reference(*leaves, causal)
    out.backward(d_out.to(dtype))
    return {"O": out, "L": lse, **{n: t.grad for n, t in zip(("dQ", "dK", "dV"), leaves, strict=True)}}


def _miss(
    name: str, got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, dtype: str, where: str
) -> str | None:
    if tuple(got.shape) != tuple(ref.shape):
        return f"{name}: shape {tuple(got.shape)} != expected {tuple(ref.shape)} ({where})"
    err = outcome.max_abs(got, ref)
    base_err = outcome.max_abs(base, ref)
    scale = ref.detach().abs().max().item()
    floor = FLOOR[(dtype, got.device.type)]
    bound = max(FACTOR * base_err, floor * scale)
    if math.isfinite(err) and err <= bound:
        return None
    return (
        f"max |{name} - float64| = {outcome.fmt(err)} > bound {outcome.fmt(bound)} = max({FACTOR:g} x plain "
        f"PyTorch {dtype}'s error {outcome.fmt(base_err)}, {floor:g} x max|ref| {outcome.fmt(scale)}) ({where})"
    )


def _inputs(case: dict, device: torch.device) -> tuple[list[torch.Tensor], torch.Tensor]:
    b, nq, nk, d = case["shape"]
    gen = torch.Generator().manual_seed(nq * 1000 + nk)
    qkv = [torch.randn(b, n, d, generator=gen, dtype=torch.float64) for n in (nq, nk, nk)]
    d_out = torch.randn(b, nq, d, generator=gen, dtype=torch.float64)
    return [t.to(device) for t in qkv], d_out.to(device)


def check_match(fn: type, case: dict, device: torch.device) -> dict:
    """O, the one saved L of shape (batch, n_queries), dQ, dK, dV against float64, bounded by plain
    PyTorch's error in the same dtype."""
    dtype, causal = DTYPES[case["dtype"]], case["causal"]
    (b, nq, nk, d), name = case["shape"], case["dtype"]
    where = (
        f"{'causal' if causal else 'not causal'}, {name}, batch={b}, n_q={nq}, n_k={nk}, d={d}, {device.type}"
    )
    inputs, d_out = _inputs(case, device)
    q, k, v = (t.to(dtype).requires_grad_() for t in inputs)
    out = fn.apply(q, k, v, causal)
    saved = getattr(out.grad_fn, "saved_tensors", ())
    logsumexps = [t for t in saved if tuple(t.shape) == (b, nq)]
    out.backward(d_out.to(dtype))
    ref = _run_reference(inputs, d_out, causal, torch.float64)
    base = _run_reference(inputs, d_out, causal, dtype)  # plain PyTorch in the case's dtype: the bar
    misses = [_miss("O", out, ref["O"], base["O"], name, where)]
    if len(logsumexps) != 1:
        misses.append(
            f"saved L: expected exactly one saved tensor of shape {(b, nq)}, found {len(logsumexps)} among "
            f"the saved tensors {[tuple(t.shape) for t in saved]} ({where})"
        )
    else:
        misses.append(_miss("L", logsumexps[0], ref["L"], base["L"], name, where))
    for grad_name, t in zip(("dQ", "dK", "dV"), (q, k, v), strict=True):
        if t.grad is None:
            misses.append(f"{grad_name}: no gradient reached the input ({where})")
        else:
            misses.append(_miss(grad_name, t.grad, ref[grad_name], base[grad_name], name, where))
    return outcome.from_misses(misses)


def check_bad_input(fn: type, case: dict, device: torch.device) -> dict:
    """Mismatched shapes raise an exception (of any type, with or without a message) instead of
    returning a tensor."""
    b, nq, nk, d = case["shape"]
    shapes = {
        "bad-head-dims": ((b, nq, d), (b, nk, 2 * d), (b, nk, 2 * d)),
        "bad-kv-lengths": ((b, nq, d), (b, nq, d), (b, nk, d)),
        "bad-batch-sizes": ((b - 1, nq, d), (b, nk, d), (b, nk, d)),
    }[case["check"]]
    q, k, v = (torch.randn(s, device=device) for s in shapes)
    try:
        out = fn.apply(q, k, v, False)
    except Exception:
        return outcome.passed()
    return outcome.failed(
        f"{case['check']}: Q {shapes[0]}, K {shapes[1]}, V {shapes[2]} returned a tensor of shape "
        f"{tuple(out.shape)} instead of raising"
    )


COMPILE_HINTS = {
    "re-assigned": "usually a Python float passed to a Triton kernel (e.g. the softmax scale): inductor "
    "types it fp64 in a loop that holds fp32; pass it as tl.constexpr or cast it in the kernel",
    "dot": "usually tl.dot of fp32 and bf16 operands: cast P to V's dtype before the second tl.dot",
}


def compile_failure(exc: BaseException) -> str:
    """The first line of inductor's error and what usually causes it."""
    text = str(exc)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    # Triton's own diagnosis (e.g. "initial type fp32 is re-assigned to fp64") when there is one, else
    # the first line naming an error.
    telling = [line for line in lines if any(k in line for k in COMPILE_HINTS)]
    key = next(iter(telling), next((line for line in lines if "rror" in line), lines[0] if lines else ""))
    hint = next((h for k, h in COMPILE_HINTS.items() if k in text), "")
    return f"fails under torch.compile(apply): {type(exc).__name__}: {key[:300]}" + (
        f" ({hint})" if hint else ""
    )


def check_compile(fn: type, case: dict, device: torch.device) -> dict:
    """The leaderboard's protocol runs: ``torch.compile(apply)`` at its shape, forward and
    ``sum().backward()``, finite, and equal to the eager call within bf16 rounding."""
    b, nq, _, d = case["shape"]
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = torch.randn(3, b, nq, d, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_()
    eager = fn.apply(q, k, v, True)
    try:
        torch._dynamo.reset()
        out = torch.compile(fn.apply)(q, k, v, True)
        out.sum().backward()
    except Exception as exc:
        return outcome.failed(compile_failure(exc))
    misses = [] if bool(torch.isfinite(out).all()) else ["compiled output is not finite"]
    diff = outcome.max_abs(out, eager)
    if diff > 2e-2 * eager.abs().max().item():
        misses.append(f"compiled output differs from the eager call by {outcome.fmt(diff)}")
    return outcome.from_misses(misses)


def _refuses_cpu(exc: BaseException) -> str | None:
    """The refusal's text when a kernel rejected CPU tensors (an assert or error about CUDA)."""
    frames = traceback.extract_tb(exc.__traceback__)
    text = " ".join([str(exc), *(f.line or "" for f in frames[-2:])]).lower()
    return (
        outcome.first_line(exc) if any(w in text for w in ("cuda", "gpu", "device", "cpu tensor")) else None
    )


def _small_on_gpu(case: dict) -> bool:
    """The small Triton cases run on the GPU when there is one (the CPU runs Triton only under its
    interpreter); the small PyTorch cases stay on the CPU, where the course tests that hook."""
    return case["kind"] == "triton" and torch.cuda.is_available()


def run_case(hooks: Hooks, case: dict) -> dict:
    device = torch.device("cuda" if case["gpu"] or _small_on_gpu(case) else "cpu")
    try:
        fn = getattr(hooks, HOOK[case["kind"]])()
    except HookNotImplemented as exc:
        return outcome.skipped(exc.skip_reason)
    check = {"match": check_match, "compile": check_compile}.get(case["check"], check_bad_input)
    try:
        return check(fn, case, device)
    except Exception as exc:
        reason = _refuses_cpu(exc) if device.type == "cpu" and case["kind"] == "triton" else None
        if reason:
            return outcome.skipped(f"the Triton kernel refuses CPU tensors ({reason}); its GPU cases run it")
        return outcome.describe(exc)


def run(hooks: Hooks, args: dict[str, Any]) -> dict:
    return {cid: run_case(hooks, CASES[cid]) for cid in args["cases"]}
