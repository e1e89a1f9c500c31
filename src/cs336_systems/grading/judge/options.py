"""The judging options, declared once for both front ends: the judging process
(``python -m cs336_systems.grading.judge``, argparse) and the pytest plugin (``pytest tests/contract``),
which registers the same flags. Standard library only: the plugin loads it before any conftest.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Option:
    flag: str
    help: str
    metavar: str | None = "PATH"
    type: type | None = None
    choices: tuple[str, ...] | None = None
    default: Any = None

    def kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``argparse``'s ``add_argument`` (and of pytest's ``addoption``)."""
        found: dict[str, Any] = {"help": self.help, "default": self.default}
        if self.choices:
            found["choices"] = self.choices
        else:
            found["metavar"] = self.metavar
        if self.type is not None:
            found["type"] = self.type
        return found


OPTIONS = (
    Option(
        "--adapters",
        "an adapters file to grade and benchmark (env CS336_ADAPTERS); the contract tests default "
        "to the suite's tests/adapters.py, the benches add an 'adapters' row only when it is given",
    ),
    Option(
        "--repo-root",
        "the graded repository's root (default: the folder above the adapters file holding pyproject.toml)",
    ),
    Option(
        "--package-root",
        "the folder holding the graded cs336_systems (default: module-root in pyproject.toml, src/ or the repo root)",
    ),
    Option(
        "--basics-root",
        "the folder holding the graded cs336_basics (default: [tool.uv.sources] cs336-basics in pyproject.toml)",
    ),
    Option(
        "--grade-json",
        "write the report (groups, tiers, every case's verdict and message, the seed) to this JSON file",
    ),
    Option(
        "--grade-seed",
        "the seed of the run's inputs (default: fresh each run; the report records it)",
        "N",
        int,
    ),
    Option(
        "--grade-progress",
        "append one JSON line per graded case to this file as the run goes (a class run's progress)",
    ),
    Option(
        "--grade-tiers",
        "grade only these tiers, comma-separated (course, leaderboard, beyond; default: all)",
        "TIERS",
    ),
    Option(
        "--grade-jobs",
        "worker jobs of the graded code side by side, all started before the first verdict "
        "(default: 4 with a GPU, else half the CPU cores up to 4; 1 in a pytest-xdist worker)",
        "N",
        type=int,
    ),
    Option(
        "--grade-summary",
        "print the hook x tier table at the end (none: the report goes to --grade-json only)",
        choices=("table", "none"),
        default="table",
    ),
    Option(
        "--grade-timeout",
        "the repository's whole time limit (cli.grade's --timeout): each worker job of the graded code, "
        "and the check that the adapters file loads, gets its share of it (grading/limits.py; default 1800)",
        "SECONDS",
        type=float,
    ),
)
