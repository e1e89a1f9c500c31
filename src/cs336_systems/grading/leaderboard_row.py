"""A repository's leaderboard row as its readers see it: one record across the process boundary.

The repository's job writes the row (``repo/leaderboard/row.py``, into ``leaderboard.json`` and
``grade.json``); the class report and Gradescope's ``results.json`` read it here, so that the rank's time
has one name from the clock to the report: ``parent_ms``, the parent's clock per verified iteration.
``course_ms`` is the graded process's own ``do_bench`` mean, shown beside it, never ranked. Rows written
before the name was one (``mean_ms``) are read as the same field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

OBSERVED = "observed (ncu)"


def finite_positive(x: Any) -> float | None:
    ok = isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0
    return float(x) if ok else None


@dataclass(frozen=True)
class LeaderboardRow:
    parent_ms: float | None  # the rank's time: the parent's clock
    course_ms: float | None = None  # the graded process's own do_bench mean (the course's protocol)
    ranked: bool = False  # the row's own verdict; a row without a time is never ranked
    unranked_because: str = ""
    agreement: str = "-"
    attribution: str = "-"  # "observed (ncu)", "self-reported", "reference"
    repository_share: float | None = None
    forward: str = "-"
    backward: str = "-"
    compiled: bool = False
    compile_error: str | None = None
    repository_kernels_ran: tuple[str, ...] = ()

    @classmethod
    def read(cls, raw: Any) -> LeaderboardRow | None:
        """The row of a ``leaderboard.json`` (or ``grade.json``'s ``leaderboard``); None: not a row."""
        if not isinstance(raw, dict):
            return None
        parent = finite_positive(raw.get("parent_ms", raw.get("mean_ms")))
        share = raw.get("repository_share")
        return cls(
            parent_ms=parent,
            course_ms=finite_positive(raw.get("course_ms")),
            ranked=bool(raw.get("ranked")) and parent is not None,
            unranked_because=str(raw.get("unranked_because") or raw.get("error") or ""),
            agreement=str(raw.get("agreement") or "-"),
            attribution=str(raw.get("attribution") or "-"),
            repository_share=share if isinstance(share, int | float) else None,
            forward=str(raw.get("forward") or "-"),
            backward=str(raw.get("backward") or "-"),
            compiled=bool(raw.get("compiled")),
            compile_error=str(raw["compile_error"]) if raw.get("compile_error") else None,
            repository_kernels_ran=tuple(map(str, raw.get("repository_kernels_ran") or ())),
        )

    @property
    def observed(self) -> bool:
        return self.attribution == OBSERVED
