"""Grade an implementation: ``python -m cs336_systems.cli.grade PATH/TO/REPO`` (or its adapters file).

The contract tests run in worker processes of that repository's code; this process and the pytest run
it starts make every input and reference and decide every verdict. The hook x tier table is the last
thing printed. ``--course-tests`` also runs the repository's own course tests (its ``tests/``) and says,
per hook, whether they agree with the grader's course tier. ``--bench`` also times its Triton
FlashAttention on the 2025 leaderboard's case the course's way (one GPU). Arguments after ``--`` go to
pytest (``-- -k ddp``).

Exit status: 0 when the course tier passes (or is skipped), 1 on a course failure or when a case
cannot be graded, 2 when the repository cannot be graded at all (no adapters file, a bad path).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from cs336_systems.grading.roots import SUITE_ROOT, GradingSetupError, discover

PROG = "python -m cs336_systems.cli.grade"


def adapters_of(target: Path) -> Path:
    """The adapters file of a repository (``tests/adapters.py``), or ``target`` when it is a file."""
    if not target.exists():
        raise GradingSetupError(f"{target}: no such file or folder")
    if target.is_dir():
        found = target / "tests" / "adapters.py"
        if not found.is_file():
            raise GradingSetupError(
                f"{target} has no tests/adapters.py: the grader calls the course's hooks there "
                "(point it at the repository root, or at the adapters file itself)"
            )
        return found
    return target


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("target", type=Path, help="a student repository, or its adapters file")
    p.add_argument("--grade-json", type=Path, help="write the report (every case's verdict and message) here")
    p.add_argument(
        "--seed", type=int, help="the inputs' seed (default: fresh each run; the report records it)"
    )
    p.add_argument(
        "--course-tests", action="store_true", help="also run the repository's own course tests and compare"
    )
    p.add_argument(
        "--bench", action="store_true", help="also time the leaderboard case the course's way (one GPU)"
    )
    p.add_argument(
        "--repo-root", type=Path, help="the repository root (default: above tests/, where pyproject.toml is)"
    )
    p.add_argument(
        "--package-root",
        type=Path,
        help="the folder holding its cs336_systems (default: module-root, src/ or the root)",
    )
    p.add_argument(
        "--basics-root",
        type=Path,
        help="the folder holding its cs336_basics (default: [tool.uv.sources] cs336-basics)",
    )
    p.epilog = "Arguments after -- go to pytest, e.g. -- -k ddp"
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1 :]
    return args


def contract_command(adapters: Path, args: argparse.Namespace, report: Path) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/contract/test_hooks.py",
        f"--adapters={adapters}",
        f"--grade-json={report}",
    ]
    cmd += ["--grade-summary=none", "--no-summary", "-q", "-p", "no:cacheprovider"]
    for flag in ("repo_root", "package_root", "basics_root"):
        if getattr(args, flag) is not None:
            cmd.append(f"--{flag.replace('_', '-')}={getattr(args, flag).resolve()}")
    if args.seed is not None:
        cmd.append(f"--grade-seed={args.seed}")
    return cmd + args.pytest_args


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.grading import course_tests, summary

    args = parse(argv)
    try:
        adapters = adapters_of(args.target.expanduser().resolve())
        roots = discover(adapters, args.repo_root, args.package_root, args.basics_root)
    except GradingSetupError as exc:
        print(f"{PROG}: cannot grade: {exc}", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="cs336-grade-cli-") as tmp:
        report_file = Path(tmp) / "grade.json"
        code = subprocess.call(contract_command(adapters, args, report_file), cwd=SUITE_ROOT)
        if not report_file.is_file():
            return code or 2  # the run stopped before grading (its one line says why)
        report = json.loads(report_file.read_text())
    if args.course_tests:
        report["course_tests"] = course_tests.run(roots)
        report["agreement"] = course_tests.agreement(report["course_tests"], report["groups"], report["cases"])
    if args.grade_json:
        args.grade_json.parent.mkdir(parents=True, exist_ok=True)
        args.grade_json.write_text(json.dumps(report, indent=2))
    if args.bench:
        code_bench = _bench(adapters)
        code = max(code, code_bench)
    print()
    for line in summary.render(report):
        print(line)
    for name, verdict in report.get("agreement", {}).items():
        print(f"course tests, {name}: {verdict}")
    return summary.exit_status(report, not roots.self_grade, code)


def _bench(adapters: Path) -> int:
    import torch

    if not torch.cuda.is_available():
        print("--bench: the leaderboard row needs a CUDA GPU; none here, so it was not timed")
        return 0
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "bench/bench_flash.py",
        "-k",
        "leaderboard",
        f"--adapters={adapters}",
    ]
    return subprocess.call([*cmd, "-p", "no:cacheprovider", "-q"], cwd=SUITE_ROOT)


if __name__ == "__main__":
    sys.exit(main())
