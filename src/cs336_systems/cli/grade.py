"""Grade an implementation: ``python -m cs336_systems.cli.grade PATH/TO/REPO`` (or a path to its
adapters file), the contract tests in worker processes of that repository's code, then the per-hook,
per-tier table; ``--bench`` also times its Triton FlashAttention on the 2025 leaderboard's case, the
course's way, beside the suite's and SDPA (one GPU). Extra arguments go to pytest (``-k ddp``).

Exit status: non-zero only when a ``course``-tier check failed (or the adapters file did not load).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from cs336_systems.grading.roots import SUITE_ROOT


def adapters_of(target: Path) -> Path:
    """The adapters file of a repository (``tests/adapters.py``), or ``target`` when it is one."""
    if target.is_dir() and (target / "tests" / "adapters.py").is_file():
        return target / "tests" / "adapters.py"
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("target", type=Path, help="a student repository, or its adapters file")
    parser.add_argument("--grade-json", type=Path, help="write the per-hook results (with messages) here")
    parser.add_argument("--bench", action="store_true", help="also time the leaderboard case (needs a GPU)")
    for flag in ("--repo-root", "--package-root", "--basics-root"):
        parser.add_argument(flag, type=Path, help="override where the graded code is found")
    args, pytest_args = parser.parse_known_args(argv)
    if not (SUITE_ROOT / "tests" / "contract").is_dir():
        parser.error(
            f"the contract tests are not at {SUITE_ROOT / 'tests/contract'}: run from a checkout of the suite"
        )
    options = [f"--adapters={adapters_of(args.target.expanduser().resolve())}"]
    for flag in ("grade_json", "repo_root", "package_root", "basics_root"):
        if getattr(args, flag) is not None:
            options.append(f"--{flag.replace('_', '-')}={getattr(args, flag).resolve()}")
    cmd = [sys.executable, "-m", "pytest", "tests/contract", *options, "-p", "no:cacheprovider", *pytest_args]
    code = subprocess.call(cmd, cwd=SUITE_ROOT)
    if args.bench:
        bench = [
            sys.executable,
            "-m",
            "pytest",
            "bench/bench_flash.py",
            "-k",
            "leaderboard",
            options[0],
            "-p",
            "no:cacheprovider",
        ]
        code = max(code, subprocess.call(bench, cwd=SUITE_ROOT))
    return code


if __name__ == "__main__":
    sys.exit(main())
