"""D19: ShardedOptimizer equals the unsharded optimizer, on 2 and 3 gloo ranks.

Every rank computes the same gradients (the full batch), so the sharded optimizer must reproduce
the wrapped optimizer class exactly: AdamW and SGD with momentum over several steps, parameter
groups with their own lr / weight decay, ``add_param_group`` after training started, tied weights,
frozen parameters, an LR scheduler, and checkpoints (its own per-rank state dict, and an unsharded
one). Float64 toy models from ``tests/helpers/toy.py``; one spawn per world size.
"""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer, assign_owners

from . import adapters
from .helpers.toy import loss_fn, make_batch, make_model

TOL = 1e-12

ADAMW = (torch.optim.AdamW, dict(lr=0.05, weight_decay=0.1, betas=(0.9, 0.95)))
SGD = (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.01))


def _groups(model: torch.nn.Module, kind: str) -> list:
    """The parameter argument of the optimizer under test, on ``model``."""
    if kind == "all":
        return list(model.parameters())  # frozen ones included: they get no grad and must stay put
    if kind == "groups":
        first = list(model.fc1.parameters())
        rest = [p for p in model.parameters() if all(p is not q for q in first)]
        return [{"params": first, "lr": 0.01, "weight_decay": 0.0}, {"params": rest}]
    if kind == "late":  # `extra` joins via add_param_group after two steps
        return [p for n, p in model.named_parameters() if not n.startswith("extra")]
    raise ValueError(kind)


def _train(model, optimizer, name: str, steps: range, scheduler=None) -> None:
    for step in steps:
        x, y, mask = make_batch(name, step, 4, "all")
        optimizer.zero_grad()
        loss_fn(name, model(x, mask), y).backward()
        optimizer.step()
        if scheduler is not None:
            scheduler.step()


def _max_diff(a: torch.nn.Module, b: torch.nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters(), strict=True))


def _compare(
    model_name: str,
    optimizer: tuple,
    kind: str = "all",
    make: Callable = adapters.get_sharded_optimizer,
    schedule: bool = False,
) -> dict:
    """Sharded vs unsharded over 5 steps; returns the difference, owners and the local state size."""
    cls, kwargs = optimizer
    reference, model = make_model(model_name, 0), make_model(model_name, 0)
    opt_ref, opt = cls(_groups(reference, kind), **kwargs), make(_groups(model, kind), cls, **kwargs)
    sched_ref = torch.optim.lr_scheduler.StepLR(opt_ref, 1, gamma=0.5) if schedule else None
    sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if schedule else None
    _train(reference, opt_ref, model_name, range(2), sched_ref)
    _train(model, opt, model_name, range(2), sched)
    if kind == "late":
        opt_ref.add_param_group({"params": list(reference.extra.parameters()), "lr": 0.02})
        opt.add_param_group({"params": list(model.extra.parameters()), "lr": 0.02})
    _train(reference, opt_ref, model_name, range(2, 5), sched_ref)
    _train(model, opt, model_name, range(2, 5), sched)
    owned = [p for p in model.parameters() if opt.owner[p] == dist.get_rank()]
    diff = _max_diff(model, reference)
    opt.zero_grad()  # every parameter's gradient, not only this rank's shard
    return {
        "grads_cleared": all(p.grad is None for p in model.parameters()),
        "diff": diff,
        "owners": [opt.owner[p] for p in model.parameters() if p in opt.owner],
        "loads": opt.loads,
        "state_params": len(opt.local_optimizer.state),
        "owned_trainable": sum(p.requires_grad for p in owned),
        "lr": [g["lr"] for g in opt.param_groups],
        "lr_ref": [g["lr"] for g in opt_ref.param_groups],
    }


def _through_file(state: dict) -> dict:
    # As a checkpoint on disk: torch's load_state_dict keeps the tensors it is given, so loading a
    # live optimizer's dict would share its moments.
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


def _checkpoints() -> dict:
    """Save after 3 steps, load into fresh models + optimizers, 2 more steps: same as not stopping.
    Once from the sharded optimizer's own state dict, once from an unsharded AdamW's."""
    cls, kwargs = ADAMW
    reference = make_model("toy", 0)
    opt_ref = cls(reference.parameters(), **kwargs)
    model = make_model("toy", 0)
    opt = ShardedOptimizer(model.parameters(), cls, **kwargs)
    _train(reference, opt_ref, "toy", range(3))
    _train(model, opt, "toy", range(3))
    results = {}
    for source in ("sharded", "unsharded"):
        resumed = make_model("toy", 0)
        resumed.load_state_dict(model.state_dict())
        opt_resumed = ShardedOptimizer(
            resumed.parameters(), cls, lr=1.0
        )  # hyperparameters come from the file
        saved = opt.state_dict() if source == "sharded" else opt_ref.state_dict()
        opt_resumed.load_state_dict(_through_file(saved))
        results[source] = opt_resumed
        _train(resumed, opt_resumed, "toy", range(3, 5))
        results[f"{source}_resumed"] = resumed
    _train(reference, opt_ref, "toy", range(3, 5))
    out = {source: _max_diff(results[f"{source}_resumed"], reference) for source in ("sharded", "unsharded")}
    state = opt.state_dict()
    out["layout"] = {
        "state_keys": sorted(state["state"]),
        "owners": state["shard"]["owners"],
        "n_params": sum(len(g["params"]) for g in state["param_groups"]),
    }
    # Another rank's shard must be refused, not silently loaded.
    wrong = dict(state, shard=dict(state["shard"], rank=(dist.get_rank() + 1) % dist.get_world_size()))
    try:
        ShardedOptimizer(make_model("toy", 0).parameters(), cls, **kwargs).load_state_dict(wrong)
        out["wrong_rank"] = "loaded"
    except ValueError as exc:
        out["wrong_rank"] = str(exc)
    return out


def _with_ddp() -> float:
    """Sharded AdamW on top of bucketed DDP over shards of the batch == AdamW on the whole batch."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    cls, kwargs = ADAMW
    reference, model = make_model("tied", 0), make_model("tied", 0)
    opt_ref = cls(reference.parameters(), **kwargs)
    ddp = DDPBucketed(model, bucket_size_mb=0.0005)
    opt = ShardedOptimizer(ddp.parameters(), cls, **kwargs)
    for step in range(4):
        x, y, mask = make_batch("tied", step, 2 * world_size, "all")
        opt_ref.zero_grad()
        loss_fn("tied", reference(x, mask), y).backward()
        opt_ref.step()
        opt.zero_grad()
        ddp.on_train_batch_start()
        sl = slice(2 * rank, 2 * rank + 2)
        loss_fn("tied", ddp(x[sl], mask[sl]), y[sl]).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return _max_diff(model, reference)


def _suite() -> dict:
    return {
        "adamw": _compare("toy", ADAMW),
        "sgd": _compare("toy", SGD),
        "groups": _compare("toy", ADAMW, "groups"),
        "late": _compare("toy", SGD, "late"),
        "late_adamw": _compare("toy", ADAMW, "late"),
        "tied": _compare("tied", ADAMW),
        "scheduled": _compare("toy", SGD, schedule=True),
        "checkpoints": _checkpoints(),
        "ddp": _with_ddp(),
    }


@pytest.mark.distributed
@pytest.mark.timeout(150)
@pytest.mark.parametrize("world_size", [2, 3])
def test_sharded_optimizer_matches_unsharded(run_distributed, world_size: int) -> None:
    per_rank = run_distributed(_suite, world_size, backend="gloo", timeout=120)
    for rank, results in enumerate(per_rank):
        for case in ("adamw", "sgd", "groups", "late", "late_adamw", "tied", "scheduled"):
            r = results[case]
            assert r["diff"] < TOL, f"{case}: rank {rank} is {r['diff']:.3g} from the unsharded optimizer"
            assert r["owners"] == per_rank[0][case]["owners"], f"{case}: ranks disagree on owners"
            assert sorted(set(r["owners"])) == list(range(world_size)), f"{case}: a rank owns nothing"
            assert r["state_params"] == r["owned_trainable"], f"{case}: state held for non-owned params"
            assert r["grads_cleared"], f"{case}: zero_grad left gradients of other ranks' parameters"
        assert results["scheduled"]["lr"] == results["scheduled"]["lr_ref"] == [0.1 * 0.5**5]
        ckpt = results["checkpoints"]
        assert ckpt["sharded"] < TOL and ckpt["unsharded"] < TOL, ckpt
        owners = ckpt["layout"]["owners"]
        assert len(owners) == ckpt["layout"]["n_params"]
        owned = [i for i, o in enumerate(owners) if o == rank]
        assert set(ckpt["layout"]["state_keys"]) <= set(owned) and ckpt["layout"]["state_keys"]
        assert "holds rank" in ckpt["wrong_rank"], ckpt["wrong_rank"]
        assert results["ddp"] < 1e-10
    # Elements are balanced: no rank is ahead of another by more than the largest parameter.
    loads = per_rank[0]["adamw"]["loads"]
    largest = max(p.numel() for p in make_model("toy", 0).parameters())
    assert max(loads) - min(loads) <= largest


@pytest.mark.gpu(2)
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_sharded_optimizer_matches_unsharded_nccl(run_distributed) -> None:
    """On GPUs with nccl: the async flat broadcasts on the NCCL stream."""
    per_rank = run_distributed(_suite, 2, backend="nccl", timeout=240)
    for results in per_rank:
        for case in ("adamw", "sgd", "groups", "late", "late_adamw", "tied", "scheduled"):
            assert results[case]["diff"] < TOL, (case, results[case]["diff"])
        assert results["checkpoints"]["sharded"] < TOL and results["checkpoints"]["unsharded"] < TOL
        assert results["ddp"] < 1e-10


# -- single process --------------------------------------------------------------------------------


def test_assignment_is_greedy_largest_first() -> None:
    loads = [0, 0, 0]
    # 100 -> r0; 40 -> r1; 40 -> r2; 30 -> r1 (tie with r2: lowest rank); 5 -> r2; 1 -> r2
    assert assign_owners([5, 100, 40, 40, 30, 1], loads) == [2, 0, 1, 2, 1, 2]
    assert loads == [100, 70, 46]
    # Added later (add_param_group): balanced against what is already owned.
    assert assign_owners([50, 10], loads) == [2, 1]
    assert loads == [100, 80, 96]


def test_single_process_equals_wrapped_optimizer() -> None:
    """Without a process group it is the wrapped optimizer (world size 1); checkpoints round-trip
    and a mismatched one is refused with a clear error."""
    reference, model = make_model("toy", 0), make_model("toy", 0)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=0.05)
    opt = ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=0.05)
    assert isinstance(opt, torch.optim.Optimizer) and opt.world_size == 1
    _train(reference, opt_ref, "toy", range(3))
    _train(model, opt, "toy", range(3))
    assert _max_diff(model, reference) < TOL
    assert opt.param_groups[0]["betas"] == (0.9, 0.999)  # the wrapped class's defaults show through
    state = opt.state_dict()
    assert state["shard"] == {"rank": 0, "world_size": 1, "owners": [0] * len(state["shard"]["owners"])}
    other = ShardedOptimizer(list(model.fc1.parameters()), torch.optim.AdamW)
    with pytest.raises(ValueError, match="does not match this optimizer's parameter groups"):
        other.load_state_dict(state)
