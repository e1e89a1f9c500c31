"""Contract of ``get_sharded_optimizer(params, optimizer_cls, **kwargs)`` (both editions).

Gloo ranks (2 and 3) train the float64 toy model of ``tests/helpers/toy.py`` on the same batch
(so every rank computes the same gradients) with the sharded optimizer, beside the unsharded
``optimizer_cls`` on a copy. Checked: after every step the weights equal the unsharded optimizer's
(1e-10: float64 rounding), with per-group options and a group added by ``add_param_group`` after
training started; every rank ends with the same weights; and each rank holds optimizer state for its
own shard only: every optimized parameter has state on exactly one rank. State is looked up where a
``torch.optim.Optimizer`` keeps it: the sharded optimizer's ``.state`` and that of any optimizer it
holds as an attribute (or in a list / dict attribute), such as the wrapped ``optimizer_cls`` instance.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from cs336_systems.harness.adapters import held_optimizers
from tests.helpers.toy import loss_fn, make_batch, make_model, max_diff

from .contract import Hooks, assert_no_misses, case_results, fmt, run_rank_cases, selected_cases

HOOK = "get_sharded_optimizer"
TOL = 1e-10
STEPS = 4
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}
# (optimizer, param groups, step after which `extra` joins through add_param_group or None)
CASES = [("adamw", "groups", 2), ("sgd", "one-group", None), ("sgd", "groups", 1)]
WORLD_SIZES = (2, 3)


def _groups(model: nn.Module, kind: str) -> list:
    """Every trainable parameter but ``extra``'s (added later, or never); two groups with their own
    options, or one plain group."""
    if kind == "one-group":
        return [p for n, p in model.named_parameters() if p.requires_grad and not n.startswith("extra")]
    return [
        {"params": list(model.fc1.parameters()), "lr": 0.02},
        {"params": [*model.ln.parameters(), *model.fc2.parameters()], "weight_decay": 0.0},
    ]


def _with_state(opt: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    names = {id(p): n for n, p in model.named_parameters()}
    held = set()
    for inner in held_optimizers(opt):
        for param, state in inner.state.items():
            if any(isinstance(v, torch.Tensor) for v in state.values()):
                held.add(names.get(id(param), "<not a model parameter>"))
    return sorted(held)


def _train(hooks: Hooks, case: tuple) -> dict:
    name, groups, add_after = case
    cls, kwargs = OPTIMIZERS[name]
    model = make_model("toy", seed=0)
    reference = copy.deepcopy(model)
    opt = hooks.get_sharded_optimizer(_groups(model, groups), cls, **kwargs)
    opt_ref = cls(_groups(reference, groups), **kwargs)
    misses = []
    for step in range(STEPS):
        x, y, mask = make_batch("toy", step, 4, "all")
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            loss_fn("toy", m(x, mask), y).backward()
            o.step()
        diff = max_diff(model, reference)
        if diff > TOL:
            misses.append(f"step {step}: max |weights - unsharded {cls.__name__}'s| = {fmt(diff)} > {TOL:g}")
        if add_after == step:
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.03})
            opt_ref.add_param_group({"params": list(reference.extra.parameters()), "lr": 0.03})
    optimized = sorted(
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (add_after is not None or not n.startswith("extra"))
    )
    return {
        "misses": misses[:4],
        "with_state": _with_state(opt, model),
        "optimized": optimized,
        "params": torch.cat([p.detach().reshape(-1) for p in model.parameters()]),
    }


def sharded_rank(path: str, cases: list[tuple]) -> dict:
    return run_rank_cases(path, _train, cases)


def _ownership_misses(results: list[dict]) -> list[str]:
    owners: dict[str, list[int]] = {}
    for rank, res in enumerate(results):
        for name in res["with_state"]:
            owners.setdefault(name, []).append(rank)
    shared = {n: r for n, r in owners.items() if len(r) > 1}
    missing = [n for n in results[0]["optimized"] if n not in owners]
    misses = []
    if shared:
        misses.append(
            f"each rank must hold only its shard's state: {len(shared)} of {len(results[0]['optimized'])} "
            f"parameters have optimizer state on several ranks, e.g. {next(iter(shared))} on ranks "
            f"{shared[next(iter(shared))]}"
        )
    if missing:
        misses.append(
            f"no rank holds optimizer state for {missing} (looked in .state of the optimizers it holds)"
        )
    return misses


@pytest.mark.distributed
@pytest.mark.timeout(300)
@pytest.mark.hook(HOOK)
@pytest.mark.parametrize("world_size", WORLD_SIZES, ids=lambda ws: f"ws{ws}")
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
def test_sharded_optimizer(request, spawned, adapters_under_test, world_size: int, case: tuple) -> None:
    """Weights = the unsharded optimizer's at every step (param groups, add_param_group after
    training started), the same on every rank; each parameter's state on exactly one rank."""
    per_rank = spawned(
        sharded_rank, world_size, str(adapters_under_test), selected_cases(request, world_size)
    )
    results = case_results(per_rank, case)
    misses = [f"rank {r}: {m}" for r, res in enumerate(results) for m in res["misses"]]
    spread = max((res["params"] - results[0]["params"]).abs().max().item() for res in results)
    if spread > 0:
        misses.append(f"ranks hold different weights: max |rank r - rank 0| = {fmt(spread)}")
    assert_no_misses(misses + _ownership_misses(results))
