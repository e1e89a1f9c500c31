"""Checks of 2026's FSDP hooks: ``get_fsdp(module, compute_dtype)``, ``fsdp_on_after_backward`` and
``fsdp_gather_full_params``.

Gloo ranks train a model of ``Embedding``, ``RMSNorm`` and ``Linear`` layers on their slice of the
batch, loss on the last position, beside one process that trains a copy on the whole batch; for a low
compute dtype the copy runs Linear / Embedding weights in it for forward and backward and keeps fp32
masters, as the course's test does. Checked: parameters stay fp32 and get an fp32 ``.grad`` of their
own shape; Linear / Embedding weights are sharded (at most ceil(rows / world) rows a rank, all rows
held); replicated gradients agree across ranks; ``fsdp_gather_full_params`` gives every parameter at
full shape under the unwrapped model's names, equal to the single process's after every step.

Every tier builds the model from the student's own ``cs336_basics.model`` layers (what the course's test
and students' ``isinstance`` checks use; the suite's course-like layers where they have none).
``course`` tier: sizes 2 ranks divide (vocab 100, d_model 64, d_ff 128), fp32 and fp16, SGD, the
course's tolerances. ``beyond``: sizes no world size divides (19 / 7 / 13), 3 ranks, bf16, AdamW,
bitwise-equal replicated gradients.
"""

from __future__ import annotations

import copy
import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import course_layers, outcome
from .dist import gather, shard_batch, world
from .hooks import Hooks, run_cases

HOOKS = ("get_fsdp", "fsdp_on_after_backward", "fsdp_gather_full_params")
DTYPES = {"fp32": None, "fp16": torch.float16, "bf16": torch.bfloat16}
STEPS = 3
SIZES = {"course": (100, 64, 128), "beyond": (19, 7, 13)}  # vocab, d_model, d_ff
TOL = {
    "course": {"fp32": (1e-6, 1e-4), "fp16": (1e-4, 1e-4)},  # (atol, rtol): the course's
    "beyond": {"fp32": (1e-5, 1e-5), "fp16": (1e-4, 1e-4), "bf16": (1e-3, 1e-3)},
}


def _case(tier: str, ws: int, dtype: str, opt: str) -> dict:
    return {
        "id": f"{tier}-ws{ws}-{dtype}-{opt}",
        "tier": tier,
        "world_size": ws,
        "dtype": dtype,
        "optimizer": opt,
        "hooks": HOOKS,
    }


CASES = {
    c["id"]: c
    for c in [
        *(_case("course", 2, dt, "sgd") for dt in ("fp32", "fp16")),
        *(
            _case("beyond", ws, dt, opt)
            for ws in (2, 3)
            for dt, opt in (("fp32", "sgd"), ("fp32", "adamw"), ("fp16", "sgd"), ("bf16", "sgd"))
        ),
    ]
}


def layer_classes() -> tuple[type, type, type]:
    """(Linear, Embedding, RMSNorm): the student's own (``cs336_basics.model``) when they have them, as
    the course's test builds its model and students' ``get_fsdp`` picks what to shard by ``isinstance``;
    else the suite's course-like layers."""
    try:
        from cs336_basics.model import Embedding, Linear, RMSNorm

        return Linear, Embedding, RMSNorm
    except ImportError:
        return course_layers.Linear, course_layers.Embedding, course_layers.RMSNorm


class LayersModel(nn.Module):
    def __init__(self, layers: tuple[type, type, type], vocab: int, d: int, d_ff: int) -> None:
        super().__init__()
        linear, embedding, norm = layers
        self.embedding = embedding(vocab, d)
        self.norm = norm(d)
        self.up = linear(d, d_ff)
        self.down = linear(d_ff, d)
        self.final_norm = norm(d)
        self.lm_head = linear(d, vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        x = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.lm_head(self.final_norm(x))


def low_precision_reference(model: nn.Module, sharded: tuple[type, ...], dtype: torch.dtype) -> None:
    """Run ``model``'s Linear / Embedding weights in ``dtype`` for forward and backward while the
    parameters stay fp32 masters with fp32 gradients (the course test's single-process reference)."""

    def swap_in(m: nn.Module, *_: Any) -> None:
        m.master = m.weight.data
        m.weight.data = m.master.to(dtype)

    def swap_out(m: nn.Module, *_: Any) -> None:
        m.weight.data = m.master

    def master_grad(m: nn.Module, p: nn.Parameter) -> None:
        swap_out(m)
        p.grad = p.grad.float()

    for m in model.modules():
        if isinstance(m, sharded):
            m.register_forward_pre_hook(swap_in)
            m.register_forward_hook(swap_out)
            m.register_full_backward_pre_hook(swap_in)
            m.weight.register_post_accumulate_grad_hook(lambda p, m=m: master_grad(m, p))


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    return (
        torch.optim.SGD(params, lr=0.01)
        if name == "sgd"
        else torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    )


def _param_misses(fsdp: nn.Module, step: int) -> list[str]:
    misses = []
    for name, p in fsdp.module.named_parameters():
        if p.dtype != torch.float32:
            misses.append(f"step {step}: parameter {name} is {p.dtype}, not an fp32 master")
        elif p.requires_grad and (p.grad is None or p.grad.shape != p.shape or p.grad.dtype != torch.float32):
            got = "None" if p.grad is None else f"{p.grad.dtype} {tuple(p.grad.shape)}"
            misses.append(
                f"step {step}: {name}.grad is {got}; expected fp32 {tuple(p.shape)} (its own shape)"
            )
    return misses


def _gathered_misses(full: dict, reference: nn.Module, tol: tuple[float, float], label: str) -> list[str]:
    ref = dict(reference.named_parameters())
    if set(full) != set(ref):
        return [f"{label}: gathered names {sorted(full)} != the model's {sorted(ref)}"]
    atol, rtol = tol
    misses = []
    for n, r in ref.items():
        got = full[n].detach().double().cpu()
        if got.shape != r.shape:
            misses.append(f"{label}: gathered {n} has shape {tuple(got.shape)}, not {tuple(r.shape)}")
            continue
        err = (got - r.detach().double()).abs()
        if not bool((err <= atol + rtol * r.detach().double().abs()).all()):
            misses.append(
                f"{label}: max |gathered {n} - single process| = {outcome.fmt(err.max().item())} > atol {atol:g} + rtol {rtol:g}·|ref|"
            )
    return misses


def _sharding_misses(
    model: nn.Module, sharded: tuple[type, ...], reference: nn.Module, world_size: int
) -> list[str]:
    names = {f"{n}.weight" for n, m in reference.named_modules() if isinstance(m, sharded)}
    full = {n: p for n, p in reference.named_parameters() if n in names}
    local = {n: p.numel() for n, p in model.named_parameters() if n in names}
    misses = []
    for n, numel in local.items():
        rows = full[n].shape[0]
        bound = math.ceil(rows / world_size) * (full[n].numel() // rows)
        if numel > bound:
            misses.append(
                f"{n} is not sharded: this rank holds {numel} of its {full[n].numel()} elements (> {bound})"
            )
    held = gather(local)
    for n, p in full.items():
        together = sum(h.get(n, 0) for h in held)
        if together < p.numel():
            misses.append(f"{n}: the ranks hold {together} of its {p.numel()} elements together")
    return misses


def _replicated_misses(fsdp: nn.Module, sharded_names: set[str], step: int, bitwise: bool) -> list[str]:
    grads = {
        n: p.grad for n, p in fsdp.module.named_parameters() if n not in sharded_names and p.grad is not None
    }
    misses = []
    for n, g in grads.items():
        spread = max((o - g).abs().max().item() for o in gather(g.detach().cpu()))
        if spread > (0 if bitwise else 1e-4 * (1 + g.abs().max().item())):
            must = "bitwise equal" if bitwise else "equal within 1e-4"
            misses.append(
                f"step {step}: replicated {n}.grad differs across ranks by {outcome.fmt(spread)} (must be {must})"
            )
    return misses


def _train(hooks: Hooks, case: dict) -> list[str]:
    tier, dtype = case["tier"], case["dtype"]
    rank, world_size = world()
    layers = layer_classes()
    sharded = layers[:2]
    torch.manual_seed(42)
    model = LayersModel(layers, *SIZES[tier])
    reference = copy.deepcopy(model)
    sharded_names = {f"{n}.weight" for n, m in reference.named_modules() if isinstance(m, sharded)}
    if DTYPES[dtype] is not None:
        low_precision_reference(reference, sharded, DTYPES[dtype])
    fsdp = hooks.get_fsdp(model, compute_dtype=DTYPES[dtype])
    opt, opt_ref = (
        _optimizer(case["optimizer"], fsdp.parameters()),
        _optimizer(case["optimizer"], reference.parameters()),
    )
    vocab, tol = SIZES[tier][0], TOL[tier][dtype]
    batch = 4 * world_size if tier == "course" else 6
    misses: list[str] = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids, targets = (
            torch.randint(0, vocab, (batch, 8), generator=g),
            torch.randint(0, vocab, (batch,), generator=g),
        )
        opt.zero_grad(set_to_none=True)
        out = fsdp(shard_batch(ids, rank, world_size))
        F.cross_entropy(out[:, -1].float(), shard_batch(targets, rank, world_size)).backward()
        hooks.fsdp_on_after_backward(fsdp, opt)
        misses += _param_misses(fsdp, step) + _replicated_misses(fsdp, sharded_names, step, tier == "beyond")
        opt.step()
        opt_ref.zero_grad(set_to_none=True)
        F.cross_entropy(reference(ids)[:, -1].float(), targets).backward()
        opt_ref.step()
        label = f"after step {step}; {dtype} compute, {case['optimizer']}, world size {world_size}"
        misses += _gathered_misses(hooks.fsdp_gather_full_params(fsdp), reference, tol, label)
    return misses[:8] + _sharding_misses(fsdp.module, sharded, reference, world_size)


def run(hooks: Hooks, args: dict[str, Any]) -> dict:
    torch.use_deterministic_algorithms(True)  # as the course's FSDP test runs
    return run_cases(_train, hooks, CASES, args["cases"])
