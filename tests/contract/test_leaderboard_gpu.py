"""The leaderboard's adversaries on a GPU (``tests/data/students/leaderboard``, written for the suite):
each row is timed on the parent's clock and observed by Nsight Compute, as a class run times it; the
honest kernel keeps its rank, every way around a rule gets "no rank" naming what happened. The CPU half
of these rules: ``test_leaderboard_rules.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cs336_systems.grading.repo.leaderboard import row as leaderboard
from cs336_systems.grading.repo.leaderboard.observer import ncu_path
from cs336_systems.grading.roots import discover

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]
FIXTURE = Path(__file__).resolve().parents[1] / "data" / "students" / "leaderboard" / "tests"
PASSED = {"cases": [{"id": "c", "tier": "course", "hooks": [leaderboard.TRITON_HOOK], "status": "passed"}]}
FAILED = {
    "cases": [
        {
            "id": "course-triton-match",
            "tier": "course",
            "hooks": [leaderboard.TRITON_HOOK],
            "status": "failed",
        }
    ]
}
EXPECTED = {  # adapters file -> (the course verdict it earned, what its "no rank" names)
    "adapters_wrong.py": (FAILED, "fails the course tier"),
    "adapters_skip.py": (PASSED, "timed iterations do not match the reference"),
    "adapters_precompute.py": (PASSED, "timed iterations do not match the reference"),
    "adapters_cache.py": (PASSED, "own do_bench reported"),
    "adapters_timer.py": (PASSED, "own do_bench reported"),
    "adapters_record.py": (PASSED, "a library's attention ran in the forward"),
    "adapters_token_sdpa.py": (PASSED, "a library's attention ran in the forward"),
    "adapters_token_matmul.py": (PASSED, "of its GPU time is in its own Triton kernels"),
    "adapters_sdpa_backward.py": (PASSED, "a library's attention ran in the backward"),
    "adapters_sdpa_backward_op.py": (PASSED, "a library's attention ran in the backward"),
    # its own kernel under any observer, torch's attention timed: the parent's clock against the observed
    # kernels' time, within a limit that ends with a reason (never the repository's timeout)
    "adapters_observed_only.py": (PASSED, "the timed work is not the observed work"),
}


@pytest.fixture(scope="module", autouse=True)
def observer() -> None:
    if ncu_path() is None:
        pytest.skip("needs Nsight Compute (ncu) to observe the kernels from outside the graded process")


def _show(name: str, row: dict) -> None:
    keys = (
        "parent_ms",
        "course_ms",
        "agreement",
        "forward",
        "backward",
        "observed_ms_per_iteration",
        "ranked",
    )
    print(f"\n{name}: " + json.dumps({k: row.get(k) for k in keys} | {"why": row.get("unranked_because")}))


def test_the_honest_kernel_is_ranked_on_the_parents_clock() -> None:
    row = leaderboard.row(discover(FIXTURE / "adapters.py"), PASSED)
    _show("adapters.py", row)
    assert row["ranked"], row["unranked_because"]
    assert row["attribution"] == "observed (ncu)" and row["repository_share"] >= 0.9
    assert row["forward"].startswith("own Triton") and row["backward"].startswith("own Triton"), row
    assert row["agreement"].startswith("agree"), row["agreement"]


def test_the_handouts_design_ranks_with_its_compiled_backward_named() -> None:
    """A Triton forward and a backward in PyTorch under torch.compile: what the handout asks for."""
    row = leaderboard.row(discover(FIXTURE / "adapters_compiled_backward.py"), PASSED, budget_s=300)
    _show("adapters_compiled_backward.py", row)
    assert row["ranked"], row["unranked_because"]
    assert row["forward"].startswith("own Triton") and row["backward"].startswith("compiled PyTorch"), row


@pytest.mark.parametrize("adapters", EXPECTED)
def test_each_way_around_a_rule_gets_no_rank(adapters: str) -> None:
    report, reason = EXPECTED[adapters]
    row = leaderboard.row(discover(FIXTURE / adapters), report, budget_s=300)
    _show(adapters, row)
    assert not row["ranked"] and reason in row["unranked_because"], row
