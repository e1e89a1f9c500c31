"""The grader's own speed: one repository graded end to end (``grading.repo.repo_job.grade_repo``, what a
class run does per repository), by the tiers a TA grades. Each row is one run (grading takes tens of
seconds); ``extra_info`` splits it into the contract run and the leaderboard row.

The repository is one of the suite's student-like fixtures (``tests/data/students/``): ``src_layout``
(a PyTorch FlashAttention) for the course tier on any machine, ``triton_tile64`` (a Triton kernel of its
own) for the course and leaderboard tiers with the leaderboard row on a GPU. Goals (issue 56): the course
tier of one repository within 3 minutes on a 2-core CPU; course + leaderboard within 60 s on one H100.

    pytest bench/bench_grading.py --benchmark-json=grading.json
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from cs336_systems.grading.repo.repo_job import RepoOptions, grade_repo
from cs336_systems.harness.record import record_times
from cs336_systems.rows.schema import tag

STUDENTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "students"
CASES = {  # id -> (repository, tiers, with the leaderboard row, needs a GPU)
    "course": ("src_layout", "course", False, False),
    "course+leaderboard": ("triton_tile64", "course,leaderboard", True, True),
}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("case", list(CASES))
def test_grade_one_repository(benchmark, tmp_path: Path, case: str) -> None:
    repo, tiers, bench, needs_gpu = CASES[case]
    if needs_gpu and not torch.cuda.is_available():
        pytest.skip("the leaderboard tier and row need a CUDA GPU")
    tag(benchmark, "grading", case)
    start = time.perf_counter()
    grade_repo(STUDENTS / repo, tmp_path, RepoOptions(tiers=tiers, bench=bench, seed=0))
    seconds = time.perf_counter() - start
    report = (tmp_path / "grade.json").read_text()
    record_times(
        benchmark, [seconds * 1e3], repository=repo, tiers=tiers, bench_row=bench, report_bytes=len(report)
    )
    assert (tmp_path / "results.json").is_file()
