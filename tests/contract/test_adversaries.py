"""Code that wants a better grade than it earned (``tests/data/students/adversary``, written for the
suite): an attention that returns zeros while it patches the grader's modules in its process, or
torch's comparisons and arithmetic, or rewrites the records it wrote at exit; one that leaves with
``os._exit(0)`` mid-call; a "Triton" hook that is torch's SDPA. Each fails, naming what happened,
because the graded process only computes: the inputs, references and verdicts are made here."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.grading.shared.cases import CASES, COURSE, LEADERBOARD, REFUSES_CPU
from cs336_systems.grading.verdict import FAILED, SKIPPED

from .grading_run import STUDENTS, verdicts

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("suite_self_check")]
ADVERSARY = STUDENTS / "adversary" / "tests"
COURSE_ATTENTION = [c.id for c in CASES.values() if c.family == "attention" and c.tier == COURSE]
COURSE_TRITON = [c for c in COURSE_ATTENTION if "-triton-" in c]
EXPECTED = {  # adapters file -> what every course attention case's failure names
    "adapters_patch_grader.py": "elements outside atol 0.01 + rtol 0.01",
    "adapters_patch_torch.py": "elements outside atol 0.01 + rtol 0.01",
    "adapters_overwrite_results.py": "wrote files the grader did not ask for: verdict.json",
    "adapters_exit_early.py": "exited with code 0 before writing this case's outputs",
}


@pytest.mark.parametrize("adapters", EXPECTED)
def test_adversary_fails_every_course_case(adapters: str) -> None:
    found = verdicts(ADVERSARY / adapters, COURSE_ATTENTION)
    for case_id, verdict in found.items():
        assert verdict.status == FAILED and EXPECTED[adapters] in verdict.message, (case_id, verdict)


def test_torch_sdpa_handed_in_as_triton_fails_on_provenance() -> None:
    """The numbers are right (torch computed them); the grader names whose kernel ran."""
    for case_id, verdict in verdicts(ADVERSARY / "adapters_borrowed_sdpa.py", COURSE_TRITON).items():
        assert verdict.status == FAILED, (case_id, verdict)
        assert "no Triton kernel of this repository ran" in verdict.message, verdict.message
        assert "torch's attention ran" in verdict.message and "scaled_dot_product" in verdict.message
        assert "elements outside" not in verdict.message, "the values themselves are right"


@pytest.mark.gpu
def test_torch_sdpa_handed_in_as_triton_fails_on_a_gpu() -> None:
    lb = [c.id for c in CASES.values() if c.tier == LEADERBOARD]
    for case_id, verdict in verdicts(ADVERSARY / "adapters_borrowed_sdpa.py", COURSE_TRITON + lb).items():
        assert verdict.status == FAILED and "torch's attention ran" in verdict.message, (case_id, verdict)


def test_unmasked_tiles_pass_the_course_and_fail_below_a_tile() -> None:
    """A kernel of 64 x 64 tiles without bounds masks (the handout says none are needed): its own
    Triton kernel runs (provenance holds), the course's shapes pass, and a length of 16 fails (a crash
    under the interpreter is a failure, not a refusal of CPU tensors)."""
    small = [c.id for c in CASES.values() if c.id.startswith("beyond-triton-match-b2-q16-k16-d16-full-fp32")]
    found = verdicts(STUDENTS / "triton_tile64" / "tests" / "adapters.py", COURSE_TRITON + small)
    assert all(found[c].status == "passed" for c in COURSE_TRITON), found
    assert all(found[c].status == FAILED for c in small), found


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="on a GPU the course's Triton cases run there: nothing is refused"
)
def test_kernel_that_refuses_cpu_tensors_skips_on_the_cpu() -> None:
    for verdict in verdicts(STUDENTS / "gpu_only" / "tests" / "adapters.py", COURSE_TRITON).values():
        assert verdict.status == SKIPPED and verdict.kind == REFUSES_CPU, verdict
