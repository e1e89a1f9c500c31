"""The grading contract: every case of ``cs336_systems.grading.shared.cases`` (one table: hooks, tier,
device, dtype, shape, world size, tolerance), run in worker processes of the graded code and judged
here. ``course`` is what the course's tests run; ``leaderboard`` the 2025 leaderboard's case (Triton,
GPU); ``beyond`` what a careful implementation also gets right.

The pytest front end of the judging process (``python -m cs336_systems.grading.judge`` is the other): a
case's test is named as ``grading/judge/keywords.py``'s ``FAMILY_TESTS`` says, so that ``-k`` selects the same
cases in both."""

from __future__ import annotations

import pytest

from cs336_systems.grading.shared.cases import of_family


def _params(family: str) -> list:
    params = []
    for case in of_family(family):
        # one xdist group per job (family and world size): `-n N --dist loadgroup` runs families side by side
        group = pytest.mark.xdist_group(f"{family}-ws{case.world_size}")
        marks = [pytest.mark.hook(*case.hooks), pytest.mark.tier(case.tier), group]
        if case.world_size > 1:
            marks.append(pytest.mark.distributed)
        params.append(pytest.param(case, marks=marks, id=case.id))
    return params


@pytest.mark.timeout(1200)  # the first test of a family and world size runs the whole batch
@pytest.mark.parametrize("case", _params("attention"))
def test_attention(verdict, case) -> None:
    """O, the saved L and dQ, dK, dV against float64; the repository's own kernel ran; bad input
    raises; the leaderboard's shape runs under torch.compile."""
    verdict(case)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params("ddp"))
def test_ddp(verdict, case) -> None:
    """Broadcast at construction, each step's parameters (and, beyond, gradients) equal the
    non-parallel run's, ranks agree."""
    verdict(case)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params("sharded"))
def test_sharded_optimizer(verdict, case) -> None:
    """Parameters equal the unsharded optimizer's; beyond, each parameter's state on exactly one rank
    and equal to the unsharded state."""
    verdict(case)


@pytest.mark.timeout(1200)
@pytest.mark.parametrize("case", _params("fsdp"))
def test_fsdp(verdict, case) -> None:
    """Gathered parameters equal single-process training; gradients of the parameters' own shape and
    dtype; replicated gradients bitwise equal across ranks; beyond, sharded weights and fp32 masters."""
    verdict(case)
