"""Every time limit of one repository's grading, derived from its one ``--timeout``.

A class run gives each repository ``--timeout`` seconds end to end. The pieces inside it (the judge's
load check, each worker job of the graded code, the course's own tests, the leaderboard worker's warm-up
and rounds, the time kept for writing results) each get a share of that number, so that a stuck piece
is ended by its own limit, which names it, before the outer kill ends the whole without a reason; and a
shorter ``--timeout`` shortens them all. A share has a floor (a worker starts Python and torch, loads the
repository and may compile, two or three times slower on a loaded machine, however short the whole) and
none exceeds the whole: the outer kill stays the last word.

The record crosses each process boundary as its one number: ``options.json`` (class run to the
repository's job), the judge's ``--grade-timeout`` (job to judge), and for the leaderboard worker the
``wait_s`` of its plan. Standard library only: every process of the grader may import it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_S = 1800.0  # cli.grade's --timeout default: a repository's whole grading


@dataclass(frozen=True)
class Share:
    fraction: float  # of the repository's whole limit
    floor_s: float  # however short the whole (never more than it)


# The default whole (1800 s) gives 240, 180, 900, 900 and 30 s: the limits these pieces had as constants.
SHARES: dict[str, Share] = {
    "worker": Share(2 / 15, 120.0),  # one job of the graded code: a hook family at one world size
    "load": Share(0.1, 90.0),  # the check that the adapters file imports, before any case
    "course_tests": Share(0.5, 120.0),  # the course's own tests on the adapters file (--course-tests)
    "leaderboard_wait": Share(0.5, 60.0),  # the leaderboard worker's warm-up, and each of its rounds
    "reserve": Share(1 / 60, 5.0),  # kept at the end for the results and stopping what the code left
}


@dataclass(frozen=True)
class Limits:
    """One repository's time limits: ``repository_s`` (``--timeout``) and each piece's share of it."""

    repository_s: float = DEFAULT_S

    def __post_init__(self) -> None:
        if not self.repository_s > 0:  # also NaN
            raise ValueError(
                f"a repository's time limit must be a positive number of seconds, not {self.repository_s}"
            )

    def share(self, piece: str) -> float:
        rule = SHARES[piece]
        return min(self.repository_s, max(rule.floor_s, rule.fraction * self.repository_s))

    @property
    def worker_s(self) -> float:
        return self.share("worker")

    @property
    def load_s(self) -> float:
        return self.share("load")

    @property
    def course_tests_s(self) -> float:
        return self.share("course_tests")

    @property
    def leaderboard_wait_s(self) -> float:
        return self.share("leaderboard_wait")

    @property
    def reserve_s(self) -> float:
        return self.share("reserve")

    def as_dict(self) -> dict[str, float]:
        """What ``grade.json`` records under ``limits``: the whole and every piece's seconds."""
        return {"repository_s": self.repository_s} | {f"{p}_s": round(self.share(p), 1) for p in SHARES}
