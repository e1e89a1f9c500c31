"""The judging process: ``python -m cs336_systems.grading.judge --adapters PATH [OPTIONS] [-k EXPR]``.

Grades one adapters file against the case table, the graded code in worker processes of its own, the
inputs, references and verdicts made here (``grading/judge/judging.py``, the loop). The options are the pytest
front end's (``pytest tests/contract --adapters PATH ...``, ``grading/judge/options.py``); ``-k EXPR`` selects
cases with pytest's keyword expressions (``grading/judge/keywords.py``). ``repo_job`` runs this for every
repository of a class run; it needs no ``tests/`` folder.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn

from ..limits import Limits
from .judging import USAGE_ERROR, JudgeConfig, run
from .options import OPTIONS

PROG = "python -m cs336_systems.grading.judge"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """A usage error exits 4, as pytest's did: one status for "the command was wrong"."""
        self.print_usage(sys.stderr)
        print(f"ERROR: {message}", file=sys.stderr)
        sys.exit(USAGE_ERROR)


def parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog=PROG,
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    for option in OPTIONS:
        p.add_argument(option.flag, **option.kwargs())
    p.add_argument(
        "-k",
        dest="keyword",
        metavar="EXPR",
        help="only the cases whose names match EXPR, as pytest's -k: 'ddp', 'pytorch and course', "
        "'not leaderboard' (substrings of a case id or of its test's name, case-insensitive)",
    )
    return p


def config_of(args: argparse.Namespace) -> JudgeConfig:
    path = lambda value: Path(value) if value else None
    return JudgeConfig(
        adapters=path(args.adapters),
        repo_root=path(args.repo_root),
        package_root=path(args.package_root),
        basics_root=path(args.basics_root),
        grade_json=path(args.grade_json),
        progress=path(args.grade_progress),
        seed=args.grade_seed,
        tiers=args.grade_tiers,
        jobs=args.grade_jobs,
        keyword=args.keyword,
        summary=args.grade_summary == "table",
        limits=Limits(args.grade_timeout) if args.grade_timeout is not None else Limits(),
    )


def main(argv: list[str] | None = None) -> int:
    return run(config_of(parser().parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
