"""Runs a FlashAttention hook's ``apply(Q, K, V, is_causal)`` on the inputs the judging process gave and
returns what came out: O, every tensor the forward saved of shape (batch, n_queries) (the course finds L
that way), dQ, dK, dV, and what the call ran (``provenance``). Nothing is compared here.

Checks (``case.knob("check")``): ``match`` (O, L and the gradients of ``O.backward(dO)``), ``compile``
(the leaderboard's call: ``torch.compile(apply)(q, k, v, True).sum().backward()`` on q, k, v unpacked from
one leaf), and the ``bad-*`` inputs (mismatched shapes: whether the call raised).
"""

from __future__ import annotations

from typing import Any

import torch

from ..shared.cases import Case
from ..shared.dtypes import DTYPES
from .provenance import Recorder


def _grads(*leaves: torch.Tensor) -> dict[str, torch.Tensor | None]:
    return {n: t.grad for n, t in zip(("dQ", "dK", "dV"), leaves, strict=True)}


def run_match(fn: type, case: Case, inputs: dict, device: torch.device, recorder: Recorder) -> dict[str, Any]:
    b, nq = case.shape[0], case.shape[1]
    dtype = DTYPES[case.dtype]
    q, k, v = (inputs[n].to(device=device, dtype=dtype).requires_grad_() for n in ("q", "k", "v"))
    with recorder.active("forward"):
        out = fn.apply(q, k, v, case.knob("causal"))
    saved = list(getattr(out.grad_fn, "saved_tensors", None) or ())
    with recorder.active("backward"):
        out.backward(inputs["dO"].to(device=device, dtype=dtype))
    return {
        "O": out,
        "L": [t for t in saved if tuple(t.shape) == (b, nq)],
        "saved_shapes": [list(t.shape) for t in saved],
        **_grads(q, k, v),
    }


def run_compile(
    fn: type, case: Case, inputs: dict, device: torch.device, recorder: Recorder
) -> dict[str, Any]:
    qkv = inputs["qkv"].to(device).requires_grad_()
    q, k, v = qkv  # one leaf, unpacked, as the leaderboard's script makes them
    torch._dynamo.reset()
    flash = torch.compile(fn.apply)
    flash(q, k, v, case.knob("causal"))  # compile outside the recorded call
    qkv.grad = None
    with recorder.active():
        out = flash(q, k, v, case.knob("causal"))
        out.sum().backward()
    dq, dk, dv = qkv.grad
    return {"O": out, "dQ": dq, "dK": dk, "dV": dv}


def run_bad_input(fn: type, case: Case, device: torch.device) -> dict[str, Any]:
    b, nq, nk, d = case.shape
    shapes = {
        "bad-head-dims": ((b, nq, d), (b, nk, 2 * d), (b, nk, 2 * d)),
        "bad-kv-lengths": ((b, nq, d), (b, nq, d), (b, nk, d)),
        "bad-batch-sizes": ((b - 1, nq, d), (b, nk, d), (b, nk, d)),
    }[case.knob("check")]
    q, k, v = (torch.randn(s, device=device) for s in shapes)
    try:
        out = fn.apply(q, k, v, False)
    except Exception:
        return {"raised": True, "shapes": [list(s) for s in shapes]}
    return {"raised": False, "shapes": [list(s) for s in shapes], "out_shape": list(out.shape)}


def run(fn: type, case: Case, inputs: dict, device: torch.device, recorder: Recorder) -> dict[str, Any]:
    check = case.knob("check")
    if check == "match":
        return run_match(fn, case, inputs, device, recorder)
    if check == "compile":
        return run_compile(fn, case, inputs, device, recorder)
    return run_bad_input(fn, case, device)
