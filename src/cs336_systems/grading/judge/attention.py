"""Judging the FlashAttention hooks: the inputs, the float64 reference and every comparison, here.

``course`` cases compare as the course's tests do (``assert_close(rtol=1e-2, atol=1e-2)`` for O, the one
saved L of shape (batch, n_queries), dQ, dK, dV). ``beyond`` and ``leaderboard`` cases bound the error
against float64 by ``max(10 x plain PyTorch attention's error in the same dtype, floor x max|ref|)``, as
FlashAttention's own tests bound theirs. Every case also reads what the call ran (``provenance``).
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch

from ..exchange import Untrusted, field, tensor, text
from ..shared.cases import REFUSES_CPU, Case, Tolerance
from ..shared.dtypes import DTYPES
from ..verdict import Verdict, fmt
from . import provenance
from .compare import max_diff, outside

CHUNK_BYTES = 1 << 31  # the reference's scores are computed a batch slice at a time under this size


def make_inputs(case: Case, gen: torch.Generator) -> dict[str, torch.Tensor]:
    b, nq, nk, d = case.shape
    check = case.knob("check")
    if check == "compile":  # the leaderboard's inputs: one leaf of (3, heads, seq, d) in its dtype
        return {"qkv": torch.randn(3, b, nq, d, generator=gen).to(DTYPES[case.dtype])}
    if check != "match":
        return {}
    q, k, v = (torch.randn(b, n, d, generator=gen, dtype=torch.float64) for n in (nq, nk, nk))
    return {"q": q, "k": k, "v": v, "dO": torch.randn(b, nq, d, generator=gen, dtype=torch.float64)}


def reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain attention in the inputs' dtype and its logsumexp (masked scores get -1e6, the handout's
    convention)."""
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        n_q, n_k = q.shape[-2], k.shape[-2]
        masked = torch.arange(n_k, device=q.device)[None, :] > torch.arange(n_q, device=q.device)[:, None]
        s = s + (masked * -1e6).to(s.dtype)
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def run_reference(
    qkv: list[torch.Tensor], d_out: torch.Tensor, causal: bool, dtype: torch.dtype, device: torch.device
) -> dict[str, torch.Tensor]:
    """O, L, dQ, dK, dV of plain attention in ``dtype`` on ``device`` (CPU results), a batch slice at a
    time so that the leaderboard's shape fits."""
    b, nq, _ = qkv[0].shape
    per_row = nq * qkv[1].shape[1] * torch.finfo(dtype).bits // 8 * 3
    step = max(1, CHUNK_BYTES // max(per_row, 1))
    parts: dict[str, list[torch.Tensor]] = {n: [] for n in ("O", "L", "dQ", "dK", "dV")}
    for i in range(0, b, step):
        leaves = [t[i : i + step].to(device=device, dtype=dtype).requires_grad_() for t in qkv]
        out, lse = reference(*leaves, causal)
        out.backward(d_out[i : i + step].to(device=device, dtype=dtype))
        for name, t in zip(parts, (out, lse, *(x.grad for x in leaves)), strict=True):
            parts[name].append(t.detach().cpu())
    return {n: torch.cat(ts) for n, ts in parts.items()}


def _course_miss(name: str, got: torch.Tensor, ref: torch.Tensor, tol: Tolerance, where: str) -> str | None:
    bad = outside(got, ref, tol)
    if not bool(bad.any()):
        return None
    return (
        f"{name}: {int(bad.sum())} of {bad.numel()} elements outside {tol.describe()}, "
        f"max |{name} - reference| = {fmt(max_diff(got, ref))} ({where})"
    )


def _relative_miss(
    name: str, got: torch.Tensor, ref: torch.Tensor, base: torch.Tensor, tol: Tolerance, where: str
) -> str | None:
    err = (got.double() - ref.double()).abs().max().item()
    base_err = (base.double() - ref.double()).abs().max().item()
    scale = ref.double().abs().max().item()
    bound = max(tol.plain_factor * base_err, tol.floor * scale)
    if err <= bound:
        return None
    return (
        f"max |{name} - float64| = {fmt(err)} > bound {fmt(bound)} = max({tol.plain_factor:g} x plain PyTorch's "
        f"error {fmt(base_err)}, {tol.floor:g} x max|ref| {fmt(scale)}) ({where})"
    )


def _where(case: Case, device: torch.device) -> str:
    b, nq, nk, d = case.shape
    mask = "causal" if case.knob("causal") else "not causal"
    return f"{mask}, {case.dtype}, batch={b}, n_q={nq}, n_k={nk}, d={d}, {device.type}"


def _outputs(case: Case, result: Any, leaderboard: bool) -> dict[str, torch.Tensor]:
    b, nq, nk, d = case.shape
    dtype = DTYPES[case.dtype]
    shapes = {"O": (b, nq, d), "dQ": (b, nq, d), "dK": (b, nk, d), "dV": (b, nk, d)}
    if not isinstance(result, dict):
        raise Untrusted("the output record holds no result")
    got = {n: tensor(result.get(n), n, s, dtype) for n, s in shapes.items()}
    if not leaderboard:
        candidates = field(result, "L", list, "L")
        saved = [tuple(s) for s in field(result, "saved_shapes", list, "saved_shapes") if isinstance(s, list)]
        if len(candidates) != 1:
            raise Untrusted(
                f"saved L: expected exactly one saved tensor of shape {(b, nq)}, found {len(candidates)} among the "
                f"saved tensors {saved} (the course finds L that way)"
            )
        got["L"] = tensor(candidates[0], "L", (b, nq))
    return got


def judge_match(case: Case, inputs: dict, result: Any, device: torch.device) -> list[str | None]:
    where = _where(case, device)
    qkv = [inputs[n] for n in ("q", "k", "v")] if "q" in inputs else list(inputs["qkv"].double())
    d_out = (
        inputs["dO"]
        if "dO" in inputs
        else torch.ones(case.shape[0], case.shape[1], case.shape[3], dtype=torch.float64)
    )
    got = _outputs(case, result, leaderboard=case.knob("check") == "compile")
    ref = run_reference(qkv, d_out, case.knob("causal"), torch.float64, device)
    tol = case.tolerance
    if tol.plain_factor is None:
        return [_course_miss(n, got[n], ref[n], tol, where) for n in got]
    base = run_reference(qkv, d_out, case.knob("causal"), DTYPES[case.dtype], device)
    return [_relative_miss(n, got[n], ref[n], base[n], tol, where) for n in got]


def judge_bad_input(case: Case, result: Any) -> list[str | None]:
    raised = field(result, "raised", bool, case.knob("check"))
    if raised:
        return []
    shapes = field(result, "shapes", list, "shapes")
    return [f"{case.knob('check')}: Q, K, V of shapes {text(shapes)} returned a tensor instead of raising"]


COMPILE_HINTS = {
    "re-assigned": "usually a Python float passed to a Triton kernel (e.g. the softmax scale): inductor "
    "types it fp64 in a loop that holds fp32; pass it as tl.constexpr or cast it in the kernel",
    "dot": "usually tl.dot of fp32 and bf16 operands: cast P to V's dtype before the second tl.dot",
}


def compile_failure(message: str) -> str:
    """The telling line of inductor's error and what usually causes it."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    telling = [line for line in lines if any(k in line for k in COMPILE_HINTS)]
    key = next(iter(telling), next((line for line in lines if "rror" in line), lines[0] if lines else ""))
    hint = next((h for k, h in COMPILE_HINTS.items() if k in message), "")
    return f"fails under torch.compile(apply): {text(key, 300)}" + (f" ({hint})" if hint else "")


def judge_raised(case: Case, payload: dict, roots: list[Path], on_gpu: bool) -> Verdict:
    """A call that raised: a refusal of CPU tensors (a stand-in case, on a CPU, that raised before any
    Triton kernel of the repository launched) skips; anything else fails, naming where."""
    message = text(payload.get("message", "raised"))
    if case.knob("check") == "compile":
        return Verdict.failed(compile_failure(text(payload.get("text", message), 4000)))
    stand_in = case.device == "cuda" and not on_gpu
    if stand_in and case.knob("kind") == "triton":
        facts = provenance.read(payload.get("provenance"), roots)
        if not facts["launched_repo"]:
            return Verdict.skipped(
                REFUSES_CPU, f"the Triton kernel refuses CPU tensors ({message}); its GPU cases run it"
            )
    frame = text(payload.get("student_frame") or payload.get("innermost_frame") or "", 300)
    under = " under Triton's CPU interpreter" if stand_in and case.knob("kind") == "triton" else ""
    return Verdict.failed(f"raised {message}{under}" + (f" (at {frame})" if frame else ""))


@functools.lru_cache(maxsize=64)
def source_kernels(roots: tuple[Path, ...]) -> frozenset[str]:
    from .kernel_names import repository_kernels

    return frozenset(repository_kernels(list(roots)))


def judge(case: Case, inputs: dict, payload: dict, roots: list[Path], device: torch.device) -> Verdict:
    """A call that returned (``judge_raised`` takes those that raised): its outputs and provenance."""
    result = payload.get("result")
    if case.knob("check") not in ("match", "compile"):
        return Verdict.from_misses(judge_bad_input(case, result))
    on_gpu = device.type == "cuda"
    names = source_kernels(tuple(roots)) if on_gpu else None
    misses = provenance.attention_misses(case.knob("kind"), payload.get("provenance"), roots, on_gpu, names)
    try:
        misses += judge_match(case, inputs, result, device)
    except Untrusted as exc:
        misses.append(str(exc))
    return Verdict.from_misses(misses)
