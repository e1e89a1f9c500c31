"""Checks of ``get_sharded_optimizer(params, optimizer_cls, **kwargs)`` (both editions).

Gloo ranks train a float64 model on the same batch (so every rank computes the same gradients) with
the sharded optimizer, beside the unsharded ``optimizer_cls`` on a copy. Checked: after every step the
weights equal the unsharded optimizer's (course: float32 and ``assert_close``'s tolerances; beyond:
float64, 1e-10), the same on every rank, and each rank holds optimizer
state for its own shard only (every optimized parameter has state on exactly one rank: the handout's
point of sharding). State is looked up in the optimizer's ``.state`` and in that of any optimizer it
holds. ``course`` tier: AdamW, one group, 2 ranks; ``beyond``: per-group options, ``add_param_group``
after training started, SGD with momentum, 3 ranks.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn as nn

from . import outcome
from .dist import gather, world
from .hooks import Hooks, held_optimizers, run_cases
from .models import TOL, loss_fn, make_batch, make_model, max_diff, within

HOOK = "get_sharded_optimizer"
STEPS = 4
OPTIMIZERS = {
    "adamw": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
}


def _case(tier: str, ws: int, model: str, opt: str, groups: str, add_after: int | None) -> dict:
    cid = f"{tier}-ws{ws}-{model}-{opt}-{groups}" + (f"-add{add_after}" if add_after is not None else "")
    return {
        "id": cid,
        "tier": tier,
        "world_size": ws,
        "model": model,
        "optimizer": opt,
        "groups": groups,
        "add_after": add_after,
        "hooks": (HOOK,),
    }


CASES = {
    c["id"]: c
    for c in [
        _case("course", 2, "course", "adamw", "one-group", None),
        *(
            _case("beyond", ws, "toy", *row)
            for ws in (2, 3)
            for row in (("adamw", "groups", 2), ("sgd", "one-group", None), ("sgd", "groups", 1))
        ),
    ]
}


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


def _ownership_misses(with_state: list[list[str]], optimized: list[str]) -> list[str]:
    owners: dict[str, list[int]] = {}
    for rank, names in enumerate(with_state):
        for name in names:
            owners.setdefault(name, []).append(rank)
    shared = {n: r for n, r in owners.items() if len(r) > 1}
    missing = [n for n in optimized if n not in owners]
    misses = []
    if shared:
        example = next(iter(shared))
        misses.append(
            f"each rank must hold only its shard's state: {len(shared)} of {len(optimized)} parameters have "
            f"optimizer state on several ranks, e.g. {example} on ranks {shared[example]}"
        )
    if missing:
        misses.append(
            f"no rank holds optimizer state for {missing} (looked in .state of the optimizers it holds)"
        )
    return misses


def _train(hooks: Hooks, case: dict) -> list[str]:
    cls, kwargs = OPTIMIZERS[case["optimizer"]]
    add_after, name = case["add_after"], case["model"]
    model = make_model(name, seed=0)
    reference = copy.deepcopy(model)
    opt = hooks.get_sharded_optimizer(_groups(model, case["groups"]), cls, **kwargs)
    opt_ref = cls(_groups(reference, case["groups"]), **kwargs)
    misses = []
    for step in range(STEPS):
        x, y, mask = make_batch(name, step, 4, "all", world()[1])
        for m, o in ((model, opt), (reference, opt_ref)):
            o.zero_grad()
            loss_fn(name, m(x, mask), y).backward()
            o.step()
        if not all(
            within(p, r, case["tier"])
            for p, r in zip(model.parameters(), reference.parameters(), strict=True)
        ):
            diff = max_diff(model, reference)
            misses.append(
                f"step {step}: max |weights - unsharded {cls.__name__}'s| = {outcome.fmt(diff)} > {TOL[case['tier']][0]:g}"
            )
        if add_after == step:
            opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.03})
            opt_ref.add_param_group({"params": list(reference.extra.parameters()), "lr": 0.03})
    optimized = sorted(
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (add_after is not None or not n.startswith("extra"))
    )
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    spread = max((p - params).abs().max().item() for p in gather(params))
    differ = (
        [f"ranks hold different weights: max |rank r - rank 0| = {outcome.fmt(spread)}"] if spread > 0 else []
    )
    return differ + misses[:4] + _ownership_misses(gather(_with_state(opt, model)), optimized)


def run(hooks: Hooks, args: dict[str, Any]) -> dict:
    return run_cases(_train, hooks, CASES, args["cases"])
