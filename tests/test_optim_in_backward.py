"""The optimizer step inside the backward (``distributed.optim_in_backward``) on the suite's FSDP:
2 ranks on gloo, the same model trained 3 steps (the learning rate halved after each, through
``param_groups`` as a schedule would) with the plain step (backward, synchronize, step) and with each
unit stepped as its reduce-scatter finishes; the parameters must be bitwise equal, in fp32
and with bf16 compute over fp32 masters, with torch's AdamW and the suite's FusedAdamW (its Triton
kernel runs under TRITON_INTERPRET=1 on the CPU). And the gradients must actually go early: once the
backward has returned, no unit whose reduce-scatter has been waited on still holds a gradient."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.distributed.comm import shard_batch
from cs336_systems.distributed.fsdp import FSDP
from cs336_systems.distributed.optim_in_backward import OptimizerInBackward
from cs336_systems.kernels.checks import INTERPRET

from .helpers.course_layers import Embedding, Linear, RMSNorm

# One xdist group (tox runs `--dist loadgroup`): the module runs in one worker, which makes its
# fixture's spawn once rather than once per worker.
pytestmark = pytest.mark.xdist_group("test_optim_in_backward")

VOCAB, D, HIDDEN, BATCH, SEQ, STEPS = 19, 8, 13, 4, 5, 3


class Net(nn.Module):
    """Embedding, three pre-norm MLP layers, final norm, LM head: 8 sharded layers (8 units), 4
    replicated norm gains; rows (19, 13) divide by no world size, so shards are padded."""

    def __init__(self):
        super().__init__()
        self.embedding = Embedding(VOCAB, D)
        self.norms = nn.ModuleList(RMSNorm(D) for _ in range(3))
        self.up = nn.ModuleList(Linear(D, HIDDEN) for _ in range(3))
        self.down = nn.ModuleList(Linear(HIDDEN, D) for _ in range(3))
        self.ln_final = RMSNorm(D)
        self.lm_head = Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embedding(ids)
        for norm, up, down in zip(self.norms, self.up, self.down, strict=True):
            x = x + down(F.gelu(up(norm(x))))
        return self.lm_head(self.ln_final(x))


def _optimizer(name: str, params: list[nn.Parameter]):
    kwargs = dict(lr=0.01, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if name == "fused":
        from cs336_systems.kernels.fused_adamw import FusedAdamW

        return FusedAdamW(params, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


def _train(
    in_backward: bool, optim: str, compute_dtype: torch.dtype | None, frozen: tuple[str, ...] = ()
) -> dict:
    """3 steps; ``frozen``: names of the Net's parameters that do not train."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    net = Net()
    for name, p in net.named_parameters():
        p.requires_grad_(name not in frozen)
    fsdp = FSDP(net, compute_dtype=compute_dtype)
    if in_backward:
        opt = OptimizerInBackward(fsdp, lambda ps: _optimizer(optim, ps))
    else:
        opt = _optimizer(optim, [p for p in fsdp.parameters() if p.requires_grad])
    shards = [p for unit in fsdp.unit_shards() for p in unit]
    grads_after_backward = []
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + step)
        ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        local = shard_batch(ids, rank, world_size)
        logits = fsdp(local[:, :-1])
        F.cross_entropy(logits.float().reshape(-1, VOCAB), local[:, 1:].reshape(-1)).backward()
        grads_after_backward.append(sum(p.grad is not None for p in shards))
        fsdp.finish_gradient_synchronization()
        opt.step()
        opt.zero_grad(set_to_none=True)
        for group in opt.param_groups:  # a learning-rate schedule: every unit's optimizer must see it
            group["lr"] *= 0.5
    return {
        "params": fsdp.gather_full_params(),
        "grads_after_backward": grads_after_backward,
        "stepped": getattr(opt, "stepped_in_backward", None),
        "units": len(fsdp.unit_shards()),
        "trainable_units": sum(bool(shards) for shards in fsdp.unit_shards()),
    }


def _rank(cases: list[tuple[str, torch.dtype | None]]) -> dict:
    torch.use_deterministic_algorithms(True)
    warnings.simplefilter("error")
    warnings.filterwarnings("ignore", category=DeprecationWarning, module="triton")
    return {case: {mode: _train(mode, *case) for mode in (False, True)} for case in cases}


CASES = [("torch", None), ("torch", torch.bfloat16)]
if INTERPRET or torch.cuda.is_available():
    CASES += [("fused", None), ("fused", torch.bfloat16)]


@pytest.fixture(scope="module")
def runs() -> dict:
    from cs336_systems.distributed.launch import spawn

    return spawn(_rank, 2, CASES, backend="gloo", timeout=60)[0]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[f"{o}-{'bf16' if d else 'fp32'}" for o, d in CASES])
def test_in_backward_equals_plain_step(runs: dict, case: tuple) -> None:
    """3 steps: every parameter bitwise equal to the plain step's (torch.equal, not allclose)."""
    plain, inside = runs[case][False]["params"], runs[case][True]["params"]
    assert plain.keys() == inside.keys()
    for name in plain:
        assert torch.equal(plain[name], inside[name]), name
    assert inside.keys() and not all(torch.equal(plain[n], plain[n] * 0) for n in plain)


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES, ids=[f"{o}-{'bf16' if d else 'fp32'}" for o, d in CASES])
def test_gradients_are_freed_during_backward(runs: dict, case: tuple) -> None:
    """Plain: after ``backward`` the units whose reduce-scatters were waited on (all but the last
    two in flight) hold their gradient shards. In backward: none does (each stepped and freed its
    own), and every unit stepped once per step."""
    plain, inside = runs[case][False], runs[case][True]
    assert all(n >= plain["units"] - 2 for n in plain["grads_after_backward"]), plain
    assert inside["grads_after_backward"] == [0] * STEPS, inside
    assert inside["stepped"] == STEPS * inside["units"]


# up.1 is the third of the 8 units (embedding, up.0, up.1, ...): a unit with no trainable shard between
# trainable ones, so every later unit's index is past it.
FROZEN = ("up.1.weight",)


def _frozen_rank() -> dict:
    torch.use_deterministic_algorithms(True)
    torch.manual_seed(0)  # _train's seed: the frozen weight's value
    initial = Net().state_dict()
    return {
        "runs": {mode: _train(mode, "torch", None, FROZEN) for mode in (False, True)},
        "initial": {name: initial[name] for name in FROZEN},
    }


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_a_frozen_unit_between_trainable_ones() -> None:
    """A unit without trainable shards announces no gradients and has no optimizer: each other unit's
    optimizer must still be the one its index names (one process: the property is the bookkeeping, not
    the collectives). Break tried: the optimizers numbered after dropping the frozen unit (its
    successors' indices shift by one) -> a unit's optimizer steps before its gradients exist, another
    never steps: parameters differ from the plain step's, gradients are left after the backward."""
    from cs336_systems.distributed.launch import spawn

    [result] = spawn(_frozen_rank, 1, backend="gloo", timeout=60)
    plain, inside = result["runs"][False], result["runs"][True]
    assert inside["trainable_units"] == inside["units"] - len(FROZEN)
    for name in plain["params"]:
        assert torch.equal(plain["params"][name], inside["params"][name]), name
    for name, before in result["initial"].items():  # frozen: not stepped by anyone's optimizer
        assert torch.equal(inside["params"][name], before), name
    assert inside["grads_after_backward"] == [0] * STEPS, inside
    assert inside["stepped"] == STEPS * inside["trainable_units"]


def _clip_rank() -> dict:
    """Global-norm clipping on ours FSDP (the plain step's fallback when clipping is asked): the norm
    it computes from shards, and the full gradients before and after, gathered."""
    from cs336_systems.training.clipping import clip_grad_norm_

    rank, world_size = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    fsdp = FSDP(Net())
    ids = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(7))
    local = shard_batch(ids, rank, world_size)
    F.cross_entropy(fsdp(local[:, :-1]).reshape(-1, VOCAB), local[:, 1:].reshape(-1)).backward()
    fsdp.finish_gradient_synchronization()
    before = fsdp.gather_full_params(grads=True)
    norm = clip_grad_norm_(fsdp, max_norm=0.1)
    return {"norm": norm, "before": before, "after": fsdp.gather_full_params(grads=True)}


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_clipping_uses_the_global_norm_of_the_full_gradient() -> None:
    """Shards' squared sums all-reduced, replicated gradients counted once: the norm equals the full
    gradient's, and every gradient is scaled by 0.1 / norm."""
    from cs336_systems.distributed.launch import spawn

    for r in spawn(_clip_rank, 2, backend="gloo", timeout=60):
        full = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in r["before"].values()]))
        torch.testing.assert_close(r["norm"], full, rtol=1e-5, atol=0)
        assert r["norm"] > 0.1
        for name, g in r["before"].items():
            torch.testing.assert_close(r["after"][name], g * (0.1 / (full + 1e-6)), rtol=1e-5, atol=1e-8)
