"""Contract of the DDP hooks: 1.0.5's ``get_ddp_individual_parameters`` and ``get_ddp_bucketed``
(with their ``on_after_backward`` / ``on_train_batch_start`` hooks) and 2026's ``get_ddp`` /
``ddp_on_after_backward``.

Gloo ranks (2 to 4) train the float64 toy models of ``tests/helpers/toy.py`` data-parallel while each
rank also trains one model on the whole batch. The models have a frozen layer, a buffer, a tied
weight (embedding = output head) and a layer that no rank uses in a step (no gradient anywhere), or
only rank 0 does (bucketed only).
Ranks start from different weights, so the wrapper must broadcast rank 0's. Checked at every step,
after the after-backward hook: each gradient equals the full-batch one (so it is the average over
ranks, not the sum); after the last step: the weights equal the single-process ones and every rank
holds the same weights. Float64 throughout: the tolerance is rounding (1e-10).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from cs336_systems.distributed.comm import shard_batch, world
from tests.helpers.toy import loss_fn, make_batch, make_model, max_diff

from .contract import Hooks, assert_no_misses, case_results, fmt, run_rank_cases, selected_cases

TOL = 1e-10
STEPS, PER_RANK_BATCH = 3, 2
FAMILIES = {
    "individual": ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward"),
    "bucketed": ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"),
    "ddp2026": ("get_ddp", "ddp_on_after_backward"),
}
# (model, who uses the `extra` layer, bucket MiB (bucketed only), optimizer)
CASES = {
    # Only bucketed DDP must cope with a parameter used by some ranks and not others (rank0): the
    # per-parameter variants communicate from gradient hooks, like torch DDP without
    # find_unused_parameters, so a parameter must get a gradient on all ranks or on none.
    "individual": [("toy", "all", None, "adamw"), ("tied", "all", None, "sgd"), ("toy", "none", None, "sgd")],
    # 0.0005 MiB (512 B, 64 float64 values): buckets of unequal size, some parameters alone
    "bucketed": [
        ("toy", "rank0", 0.0005, "sgd"),
        ("tied", "all", 0.0005, "adamw"),
        ("tied", "none", 100.0, "sgd"),
    ],
    "ddp2026": [("toy", "all", None, "adamw"), ("tied", "none", None, "sgd")],
}
# One spawn per world size runs the selected cases of every family (ranks cost seconds to start).
WORLD_SIZES = {"individual": (2, 3), "bucketed": (2, 4), "ddp2026": (2, 3)}


def _optimizer(name: str, params) -> torch.optim.Optimizer:
    # No weight decay or momentum on SGD: a parameter without gradient may be left with None or with
    # zeros, both are fair, and plain SGD moves neither.
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def _wrap(hooks: Hooks, family: str, model: nn.Module, bucket_mb: float | None) -> nn.Module:
    if family == "individual":
        return hooks.get_ddp_individual_parameters(model)
    if family == "bucketed":
        return hooks.get_ddp_bucketed(model, bucket_mb)
    return hooks.get_ddp(model)


def _after_backward(hooks: Hooks, family: str, ddp: nn.Module, opt: torch.optim.Optimizer) -> None:
    if family == "individual":
        hooks.ddp_individual_parameters_on_after_backward(ddp, opt)
    elif family == "bucketed":
        hooks.ddp_bucketed_on_after_backward(ddp, opt)
    else:
        hooks.ddp_on_after_backward(ddp, opt)


def _grad_misses(ddp_model: nn.Module, reference: nn.Module, step: int, world_size: int) -> list[str]:
    misses = []
    names = dict(reference.named_parameters())
    for (name, p), ref in zip(ddp_model.named_parameters(), names.values(), strict=True):
        if ref.grad is None:
            if p.grad is not None and p.grad.abs().max().item() > 0:
                misses.append(f"step {step}: {name} has no gradient on any rank but got a nonzero one")
            continue
        grad = torch.zeros_like(ref.grad) if p.grad is None else p.grad
        err = (grad - ref.grad).abs().max().item()
        if err <= TOL:
            continue
        summed = (grad - world_size * ref.grad).abs().max().item() <= TOL
        why = f": gradients summed, not averaged (= {world_size} x the full-batch gradient)" if summed else ""
        misses.append(f"step {step}: max |grad {name} - full-batch grad| = {fmt(err)} > {TOL:g}{why}")
    return misses


def _train(hooks: Hooks, case: tuple) -> dict:
    """This rank's data-parallel run of ``case`` against a full-batch run in the same process."""
    family, model_name, extra, bucket_mb, opt_name = case
    rank, world_size = world()
    reference = make_model(model_name, seed=0)
    local = make_model(model_name, seed=0 if rank == 0 else 100 + rank)
    ddp = _wrap(hooks, family, local, bucket_mb)
    module = ddp.module
    misses = []
    init = max_diff(module, reference)
    if init > 0:
        misses.append(
            f"parameters / buffers not broadcast from rank 0 at construction: max |rank {rank} - rank 0| = {fmt(init)}"
        )
    opt, opt_ref = _optimizer(opt_name, ddp.parameters()), _optimizer(opt_name, reference.parameters())
    global_batch = PER_RANK_BATCH * world_size
    for step in range(STEPS):
        x, y, mask = make_batch(model_name, step, global_batch, extra)
        opt_ref.zero_grad(set_to_none=True)
        loss_fn(model_name, reference(x, mask), y).backward()
        opt.zero_grad(set_to_none=True)
        if family == "bucketed":
            hooks.ddp_bucketed_on_train_batch_start(ddp, opt)
        xs, ys, ms = (shard_batch(t, rank, world_size) for t in (x, y, mask))
        loss_fn(model_name, ddp(xs, ms), ys).backward()
        _after_backward(hooks, family, ddp, opt)
        misses += _grad_misses(module, reference, step, world_size)
        opt.step()
        opt_ref.step()
    diff = max_diff(module, reference)
    if diff > TOL:
        misses.append(f"after {STEPS} steps: max |weights - single-process weights| = {fmt(diff)} > {TOL:g}")
    return {"misses": misses, "params": torch.cat([p.detach().reshape(-1) for p in module.parameters()])}


def ddp_rank(path: str, cases: list[tuple]) -> dict:
    return run_rank_cases(path, _train, cases)


PARAMS = [
    pytest.param(
        ws,
        (family, *case),
        marks=pytest.mark.hook(*FAMILIES[family]),
        id=f"{family}-ws{ws}-{'-'.join(map(str, case))}",
    )
    for family, cases in CASES.items()
    for ws in WORLD_SIZES[family]
    for case in cases
]


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.parametrize("world_size, case", PARAMS)
def test_ddp_matches_single_process(
    request, spawned, adapters_under_test, world_size: int, case: tuple
) -> None:
    """Broadcast at construction, per-step gradients = the full-batch average, final weights = the
    single-process ones and the same on every rank."""
    cases = selected_cases(request, world_size)
    per_rank = spawned(ddp_rank, world_size, str(adapters_under_test), cases)
    results = case_results(per_rank, case)
    misses = [f"rank {r}: {m}" for r, res in enumerate(results) for m in res["misses"]]
    spread = max((res["params"] - results[0]["params"]).abs().max().item() for res in results)
    if spread > 0:
        misses.append(
            f"ranks hold different weights after {STEPS} steps: max |rank r - rank 0| = {fmt(spread)}"
        )
    assert_no_misses(misses[:12])
