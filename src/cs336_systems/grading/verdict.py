"""A case's verdict, decided by the judging process only: passed, failed (naming the property that
missed and by how much), skipped (of a structured kind), or an error of the grading itself (the adapters
file did not load, a dependency is missing, the case cannot be graded faithfully)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from .shared.cases import NEEDS_GPU, NOT_IMPLEMENTED, REFUSES_CPU, UNFINISHED_HERE

PASSED, FAILED, SKIPPED, ERROR = "passed", "failed", "skipped", "error"
GRADER_RAISED = "grader-raised"  # an error kind: the judging itself raised (a bug of the grader)
MISSING_DEPENDENCY = "missing-dependency"  # an error kind: the student's code imports what is not installed
SKIP_KINDS = (NOT_IMPLEMENTED, NEEDS_GPU, REFUSES_CPU, UNFINISHED_HERE)
MAX_MISSES = 12


@dataclass(frozen=True)
class Verdict:
    status: str
    message: str = ""
    kind: str = (
        ""  # a skip kind, or an error kind (load, refused, missing-dependency, cannot-grade, grader-raised)
    )

    @staticmethod
    def passed() -> Verdict:
        return Verdict(PASSED)

    @staticmethod
    def failed(message: str) -> Verdict:
        return Verdict(FAILED, message)

    @staticmethod
    def skipped(kind: str, message: str) -> Verdict:
        assert kind in SKIP_KINDS, kind
        return Verdict(SKIPPED, message, kind)

    @staticmethod
    def error(kind: str, message: str) -> Verdict:
        return Verdict(ERROR, message, kind)

    @staticmethod
    def from_misses(misses: list[str | None]) -> Verdict:
        found = [m for m in misses if m]
        if not found:
            return Verdict.passed()
        more = f"\n... and {len(found) - MAX_MISSES} more" if len(found) > MAX_MISSES else ""
        return Verdict.failed("\n".join(found[:MAX_MISSES]) + more)


def fmt(x: float) -> str:
    return f"{x:.2g}" if math.isfinite(x) else str(x)
