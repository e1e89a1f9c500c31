"""Checks of the DDP hooks: 1.0.5's ``get_ddp_individual_parameters`` and ``get_ddp_bucketed`` (with
their ``on_after_backward`` / ``on_train_batch_start`` hooks) and 2026's ``get_ddp`` / ``ddp_on_after_backward``.

Gloo ranks train a float64 model data-parallel while each rank also trains a copy on the whole batch.
Ranks start from different weights, so the wrapper must broadcast rank 0's. Checked at every step,
after the after-backward hook: each gradient equals the full-batch one (the average over ranks, not
the sum); after the last step: the weights equal the single-process ones on every rank (1e-10).
``course`` tier: the course's model shapes at 2 ranks and its bucket sizes; ``beyond``: frozen and
unused parameters, a tied embedding, 3 and 4 ranks, buckets of unequal size. Course models are
float32 and compared as the course compares them (``torch.testing.assert_close``'s float32 tolerances);
beyond models float64 (1e-10).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from . import outcome
from .dist import gather, shard_batch, world
from .hooks import Hooks, run_cases
from .models import TOL, loss_fn, make_batch, make_model, max_diff, within

STEPS, PER_RANK_BATCH = 3, 2
FAMILIES = {
    "individual": ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward"),
    "bucketed": ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"),
    "ddp2026": ("get_ddp", "ddp_on_after_backward"),
}


def _case(family: str, tier: str, ws: int, model: str, extra: str, bucket_mb: float | None, opt: str) -> dict:
    parts = [family, tier, f"ws{ws}", model, extra, *([str(bucket_mb)] if bucket_mb else []), opt]
    return {
        "id": "-".join(parts),
        "family": family,
        "tier": tier,
        "world_size": ws,
        "model": model,
        "extra": extra,
        "bucket_mb": bucket_mb,
        "optimizer": opt,
        "hooks": FAMILIES[family],
    }


def _cases() -> list[dict]:
    cases = []
    for family in ("individual", "ddp2026"):
        cases += [_case(family, "course", 2, m, "all", None, "sgd") for m in ("course", "course-tied")]
    # the course's bucket sizes: 2 buckets, 3 buckets (one parameter each), 1 bucket
    for model, mb in (("course", 0.0016), ("course-tied", 0.0001), ("course", 0.01)):
        cases.append(_case("bucketed", "course", 2, model, "all", mb, "sgd"))
    # Only bucketed DDP must cope with a parameter used by some ranks and not others (rank0): the
    # per-parameter variants communicate from gradient hooks, like torch DDP without
    # find_unused_parameters, so a parameter must get a gradient on all ranks or on none.
    beyond = {
        "individual": (
            (3,),
            [("toy", "all", None, "adamw"), ("tied", "all", None, "sgd"), ("toy", "none", None, "sgd")],
        ),
        "ddp2026": ((3,), [("toy", "all", None, "adamw"), ("tied", "none", None, "sgd")]),
        "bucketed": (
            (2, 4),
            [
                ("toy", "rank0", 0.0005, "sgd"),
                ("tied", "all", 0.0005, "adamw"),
                ("tied", "none", 100.0, "sgd"),
            ],
        ),
    }
    for family, (sizes, rows) in beyond.items():
        cases += [_case(family, "beyond", ws, *row) for ws in sizes for row in rows]
    return cases


CASES = {c["id"]: c for c in _cases()}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    # No weight decay or momentum on SGD: a parameter without gradient may be left with None or with
    # zeros, both are fair, and plain SGD moves neither.
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _grad_misses(
    ddp_model: nn.Module, reference: nn.Module, step: int, world_size: int, tier: str
) -> list[str]:
    misses = []
    for (name, p), ref in zip(ddp_model.named_parameters(), reference.parameters(), strict=True):
        if ref.grad is None:
            if p.grad is not None and p.grad.abs().max().item() > 0:
                misses.append(f"step {step}: {name} has no gradient on any rank but got a nonzero one")
            continue
        grad = torch.zeros_like(ref.grad) if p.grad is None else p.grad
        if within(grad, ref.grad, tier):
            continue
        err = (grad - ref.grad).abs().max().item()
        summed = within(grad, world_size * ref.grad, tier)
        why = f": gradients summed, not averaged (= {world_size} x the full-batch gradient)" if summed else ""
        misses.append(
            f"step {step}: max |grad {name} - full-batch grad| = {outcome.fmt(err)} > {_tol(tier)}{why}"
        )
    return misses


def _tol(tier: str) -> str:
    atol, rtol = TOL[tier]
    return f"{atol:g}" + (f" + {rtol:g}·|ref|" if rtol else "")


def _train(hooks: Hooks, case: dict) -> list[str]:
    """This rank's data-parallel run of ``case`` against a full-batch run in the same process."""
    family, model_name = case["family"], case["model"]
    names = FAMILIES[family]
    wrap, after = getattr(hooks, names[0]), getattr(hooks, names[1])
    rank, world_size = world()
    reference = make_model(model_name, seed=0)
    local = make_model(model_name, seed=0 if rank == 0 else 100 + rank)
    ddp = wrap(local, case["bucket_mb"]) if family == "bucketed" else wrap(local)
    module = ddp.module
    misses = []
    init = max_diff(module, reference)
    if init > 0:
        misses.append(
            f"parameters / buffers not broadcast from rank 0 at construction: max |rank {rank} - rank 0| = {outcome.fmt(init)}"
        )
    opt, opt_ref = (
        _optimizer(case["optimizer"], ddp.parameters()),
        _optimizer(case["optimizer"], reference.parameters()),
    )
    for step in range(STEPS):
        x, y, mask = make_batch(model_name, step, PER_RANK_BATCH * world_size, case["extra"], world_size)
        opt_ref.zero_grad(set_to_none=True)
        loss_fn(model_name, reference(x, mask), y).backward()
        opt.zero_grad(set_to_none=True)
        if family == "bucketed":
            getattr(hooks, names[2])(ddp, opt)
        xs, ys, ms = (shard_batch(t, rank, world_size) for t in (x, y, mask))
        loss_fn(model_name, ddp(xs, ms), ys).backward()
        after(ddp, opt)
        misses += _grad_misses(module, reference, step, world_size, case["tier"])
        opt.step()
        opt_ref.step()
    if not all(
        within(p, r, case["tier"]) for p, r in zip(module.parameters(), reference.parameters(), strict=True)
    ):
        diff = max_diff(module, reference)
        misses.append(
            f"after {STEPS} steps: max |weights - single-process weights| = {outcome.fmt(diff)} > {_tol(case['tier'])}"
        )
    params = [torch.cat([p.detach().reshape(-1) for p in module.parameters()])]
    spread = max((p - params[0]).abs().max().item() for p in gather(params[0]))
    if spread > 0:
        misses.append(
            f"ranks hold different weights after {STEPS} steps: max |rank r - rank 0| = {outcome.fmt(spread)}"
        )
    return misses


def run(hooks: Hooks, args: dict[str, Any]) -> dict:
    return run_cases(_train, hooks, CASES, args["cases"])
