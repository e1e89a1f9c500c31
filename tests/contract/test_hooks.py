"""The grading contract: every hook of either edition, checked in worker processes of the graded
code (``cs336_systems.grading.worker``: attention, ddp, sharded, fsdp; each module's docstring says
what it checks and how its tiers differ). ``course`` is what the course promises; ``leaderboard`` the
2025 leaderboard's case (Triton, GPU); ``beyond`` what a careful implementation also gets right."""

from __future__ import annotations

import pytest

from cs336_systems.grading.worker import attention, ddp, fsdp, sharded


def _params(module, hooks_of) -> list:
    params = []
    for case in module.CASES.values():
        marks = [pytest.mark.hook(*hooks_of(case)), pytest.mark.tier(case["tier"])]
        if case.get("gpu"):
            marks.append(pytest.mark.gpu)
        if case.get("world_size", 1) > 1:
            marks.append(pytest.mark.distributed)
        params.append(pytest.param(case, marks=marks, id=case["id"]))
    return params


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params(attention, lambda c: (attention.HOOK[c["kind"]],)))
def test_attention(verdict, case: dict) -> None:
    """O, the saved L and dQ, dK, dV against float64 within plain PyTorch's same-dtype error; bad input
    raises; the leaderboard's shape runs under torch.compile."""
    verdict("attention", case)


@pytest.mark.timeout(1200)  # the first test of a world size runs its batch of cases
@pytest.mark.parametrize("case", _params(ddp, lambda c: c["hooks"]))
def test_ddp(verdict, case: dict) -> None:
    """Broadcast at construction, per-step gradients = the full-batch average, final weights = the
    single-process ones and the same on every rank."""
    verdict("ddp", case)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params(sharded, lambda c: c["hooks"]))
def test_sharded_optimizer(verdict, case: dict) -> None:
    """Weights = the unsharded optimizer's at every step, the same on every rank; each parameter's
    state on exactly one rank."""
    verdict("sharded", case)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params(fsdp, lambda c: c["hooks"]))
def test_fsdp(verdict, case: dict) -> None:
    """fp32 masters and gradients of the shard's shape, sharded weights, replicated gradients equal
    across ranks, gathered weights = single-process training after every step."""
    verdict("fsdp", case)
