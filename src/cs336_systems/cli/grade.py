"""Grade implementations: ``python -m cs336_systems.cli.grade TARGET... [--out DIR] [--jobs N]``.

A TARGET is a repository (holding ``tests/adapters.py``), an adapters file, or a folder of
repositories. Each repository is graded in processes of its own (its code runs in workers; the inputs,
references and verdicts are made outside it), side by side with the others: one GPU each while GPUs
last, else ``--jobs`` at a time. Per repository, ``DIR/<name>/`` gets ``grade.json`` (every case's
verdict and message), ``results.json`` (Gradescope's format) and the logs (``DIR``: ``--out``, else
``runs/grades`` of the suite's checkout; the run says where); a class run writes the class report
(``class.md``, ``class.csv``, ``class.html``), as does one repository with ``--out``. A rerun skips
repositories whose results are newer than their code and were graded with the same selection (tiers,
``-k``, ``--bench``, points, course tests; ``--force`` regrades). One repository runs as the same job as a
class's (its time limit, progress lines and process cleanup), and its hook x tier table is the last
thing printed.

Bad input stops the run with one line before anything starts: an unknown tier, an output path that
cannot be written, a target that does not exist, a folder with no repository in it, or (one repository)
an adapters file that does not parse, named by file and line.

``--course-tests [TESTS]`` also runs the course's tests (a release's ``tests/`` folder; without it,
each repository's own) on each adapters file and says, per hook, whether they agree with the grader's
course tier. ``--bench`` times each repository's Triton FlashAttention on the 2025 leaderboard's case the
course's way (GPU), beside the suite's kernel and cuDNN timed once per GPU. Arguments after ``--`` go to
the judge (``python -m cs336_systems.grading.judge``): ``-k EXPR`` grades only the cases it selects, with
pytest's keyword expressions on the case ids (``-- -k ddp``, ``-- -k "pytorch and course"``).

``--executor local|slurm`` grades a class as one submitit job per repository instead (on Slurm, or
through submitit on this machine), with the sweep's executor options (``--partition``,
``--gpus-per-job``, ``--time-min``, ``--parallelism``, ``--slurm-param``): the same files and report.

Ctrl-C (SIGINT) or ``kill`` (SIGTERM) stops the repositories being graded, records them as cancelled
and exits with one line (130, or 143); those graded are kept, and a rerun grades the others.

Exit status of one repository: 0 when its course tier passed (a case this machine cannot run as
written, for want of a GPU, aside: the score says how many); 1 when a course case failed (an adapters
file that imports what is nowhere fails every case) or a case could not be graded here (a dependency
missing from the grading environment, a machine too busy to finish it: the grade is incomplete); 2 when
the repository could not be graded at all (bad input, the worker user cannot read the grading
environment or the submission, its time limit reached as a whole, the grader failed). A class exits 0
when every repository was graded (the students' results are in its report), 1 when one could not be
graded, 2 when it did not start (bad input, or the graded code could write a neighbour or the grading
environment here and ``--accept-shared-writes`` was not given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from cs336_systems.grading.limits import DEFAULT_S, Limits
from cs336_systems.grading.roots import SUITE_ROOT
from cs336_systems.jobs.executor import ExecutorError, add_executor_options
from cs336_systems.jobs.interrupt import Interrupted

PROG = "python -m cs336_systems.cli.grade"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "targets",
        type=Path,
        nargs="+",
        metavar="TARGET",
        help="repositories, adapters files, or folders of repositories",
    )
    p.add_argument(
        "--out",
        type=Path,
        help="where each repository's results (DIR/<name>/) and the class report go (default: runs/grades "
        "of the suite's checkout; one repository writes no class report there)",
    )
    p.add_argument(
        "--jobs",
        type=int,
        help="repositories graded at once on a machine without GPUs (default: half the cores)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="worker jobs per repository side by side (its hook families, and attention's tiers; default: "
        "4 with a GPU, else 1)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_S,
        help="seconds one repository may take before it is stopped (default: 1800); each piece inside "
        "(a worker job of its code, the course's tests, the leaderboard's runs) gets a share of it",
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="grade again repositories whose results are newer than their code",
    )
    p.add_argument(
        "--tiers", help="grade only these tiers, comma-separated: course, leaderboard, beyond (default: all)"
    )
    p.add_argument(
        "--seed", type=int, help="the inputs' seed (default: fresh each run; the report records it)"
    )
    p.add_argument(
        "--points",
        type=Path,
        help="a JSON table of points per tier and hook (default: grading/gradescope.py's DEFAULT_POINTS)",
    )
    p.add_argument(
        "--grade-json",
        type=Path,
        help="one repository: also copy its report (every case's verdict and message) here",
    )
    p.add_argument(
        "--course-tests",
        nargs="?",
        const="own",
        metavar="TESTS",
        help="also run the course's tests on each adapters file and compare, hook by hook: TESTS is a course "
        "release's tests/ folder (students edit their copies); without it, each repository's own tests/",
    )
    p.add_argument(
        "--bench", action="store_true", help="also time the leaderboard case the course's way (GPU)"
    )
    p.add_argument(
        "--repo-root",
        type=Path,
        help="one repository: its root (default: above tests/, where pyproject.toml is)",
    )
    p.add_argument(
        "--package-root",
        type=Path,
        help="one repository: the folder holding its cs336_systems (default: module-root, src/ or the root)",
    )
    p.add_argument(
        "--basics-root",
        type=Path,
        help="one repository: the folder holding its cs336_basics (default: [tool.uv.sources] cs336-basics)",
    )
    p.add_argument(
        "--worker-user",
        metavar="NAME",
        help="run the graded code as this unprivileged user (when grading as root, e.g. on Gradescope)",
    )
    p.add_argument(
        "--accept-shared-writes",
        action="store_true",
        help="grade a class even where the graded code can write its neighbours' trees or the grading "
        "environment (no mount namespaces here): one repository's code can then change another's grade",
    )
    add_executor_options(p)
    # Without --executor a class is today's one-machine scheduler (classroom.ClassRun); the defaults
    # left unset here are filled in for a class (class_executor.config_for_class).
    p.set_defaults(executor=None, gpus_per_job=None, time_min=None, parallelism=None)
    p.epilog = "Arguments after -- go to the judge: -k EXPR selects cases as pytest's -k does, e.g. -- -k ddp"
    return p


def parse(argv: list[str] | None) -> argparse.Namespace:
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args = parser().parse_args(argv[:cut])
    args.judge_args = argv[cut + 1 :]
    return args


def _gpu_present() -> bool:
    """Whether the driver lists an NVIDIA GPU this process may use, read without importing torch (1.5 s
    of CPU, for one default)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    return any(Path("/proc/driver/nvidia/gpus").glob("*"))


def _options(args: argparse.Namespace):
    from cs336_systems.grading.repo.repo_job import RepoOptions

    workers = args.workers or (4 if _gpu_present() else 1)
    return RepoOptions(
        tiers=args.tiers,
        seed=args.seed,
        course_tests=args.course_tests
        if args.course_tests in (None, "own")
        else str(Path(args.course_tests).resolve()),  # one spelling per folder: a rerun compares them
        bench=args.bench,
        points=args.points.resolve() if args.points else None,
        workers=workers,
        roots=(args.repo_root, args.package_root, args.basics_root),
        judge_args=tuple(args.judge_args),
        worker_user=args.worker_user,
        limits=Limits(args.timeout),
    )


class BadInput(Exception):
    """What is wrong with the command line, found before anything is imported or started."""


def _check_tiers(tiers: str | None) -> None:
    from cs336_systems.grading.shared.cases import TIERS  # the case table's tiers (standard library only)

    unknown = [t for t in (tiers or "").split(",") if t not in TIERS] if tiers is not None else []
    if unknown:
        raise BadInput(
            f"--tiers: unknown tier {', '.join(map(repr, unknown))} (the tiers: {', '.join(TIERS)})"
        )


def _check_paths(args: argparse.Namespace) -> None:
    from cs336_systems.cli.common import unwritable

    for target in args.targets:
        if not target.expanduser().exists():
            raise BadInput(f"{target}: no such file or folder")
    if args.out is not None and (why := unwritable(args.out, directory=True)):
        raise BadInput(f"--out {args.out}: {why}")
    if args.grade_json is not None and (why := unwritable(args.grade_json)):
        raise BadInput(f"--grade-json {args.grade_json}: {why}")
    if args.points is not None:
        from cs336_systems.grading.gradescope import load_points

        try:
            load_points(args.points)
        except (OSError, ValueError) as exc:
            raise BadInput(f"--points {args.points}: {exc}") from None


def _repositories(args: argparse.Namespace) -> dict[str, Path]:
    """The repositories to grade, after every check that needs no import of torch or of graded code."""
    from cs336_systems.grading.access import worker_cannot_read
    from cs336_systems.grading.class_run.classroom import repositories
    from cs336_systems.grading.probe import syntax_problem
    from cs336_systems.grading.roots import GradingSetupError

    _check_tiers(args.tiers)
    if not args.timeout > 0:  # also NaN
        raise BadInput(
            f"--timeout {args.timeout}: a repository's time limit must be a positive number of seconds"
        )
    _check_paths(args)
    try:
        repos = repositories(args.targets)
    except GradingSetupError as exc:
        raise BadInput(str(exc)) from None
    if len(repos) == 1:  # one repository: a file that cannot load stops the run here
        (path,) = repos.values()
        adapters = path / "tests" / "adapters.py" if path.is_dir() else path
        if why := syntax_problem(adapters):
            raise BadInput(f"cannot grade: {why}")
    if args.worker_user and (why := worker_cannot_read(args.worker_user, list(repos.values()))):
        raise BadInput(f"cannot grade: {why}")  # else every case fails as if the code's
    return repos


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        repos = _repositories(args)
    except BadInput as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        return 2
    try:
        if len(repos) > 1 or args.executor:
            return grade_class(args, repos)
        return grade_one(args, repos)
    except Interrupted as exc:
        print(f"{PROG}: {exc.line('repositories')}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:  # before any repository started (importing torch, checking the input)
        print(f"{PROG}: interrupted by SIGINT before any repository started", file=sys.stderr)
        return 130


def _say_isolation(args: argparse.Namespace) -> None:
    from cs336_systems.grading import network
    from cs336_systems.grading.sandbox import Sandbox, describe

    sandbox = Sandbox.from_env()  # each repository's job makes its own network: as it will be there
    sandbox = dataclasses.replace(
        sandbox, worker_user=args.worker_user, network=network.expected(sandbox.namespaces)
    )
    print(describe(sandbox.isolation()))


def _walls_hold(args: argparse.Namespace, repos: dict[str, Path], out: Path) -> bool:
    """Probe the walls as the first repository's workers will have them (``walls.py``) and say so once;
    False (after one line) when a class would run where one repository's code can write another's tree
    or the grading environment, and the TA has not accepted that risk by name."""
    from cs336_systems.grading import walls
    from cs336_systems.grading.class_run.classroom import neighbours
    from cs336_systems.grading.sandbox import Sandbox

    first = next(iter(repos))
    sandbox = dataclasses.replace(
        Sandbox.from_env(), worker_user=args.worker_user, hidden=tuple(neighbours(repos, first))
    )
    found = walls.probe(sandbox, walls.places(list(sandbox.hidden), [out]))
    print(walls.describe(found))
    holes = walls.holes(found)
    if not holes or args.accept_shared_writes:
        return True
    if len(repos) == 1:
        print(f"warning: the graded code can write {', '.join(holes)}", file=sys.stderr)
        return True
    print(
        f"{PROG}: not grading a class here: the graded code can write {', '.join(holes)} (no mount "
        "namespaces: needs root or unprivileged user namespaces, and util-linux's unshare and setpriv); "
        "--accept-shared-writes grades anyway, knowing one repository's code can change another's grade",
        file=sys.stderr,
    )
    return False


def _class_run(args: argparse.Namespace, repos: dict[str, Path], out: Path, alone: bool = False):
    """The job machinery of a class; ``alone``: one repository with the whole machine (every core and
    every GPU visible to it, as the graded code's multi-rank cases may use them; no anchors)."""
    from cs336_systems.grading.class_run.classroom import ClassRun

    gpus, models = (0, []) if alone else _gpus()  # alone, torch is not imported here (1.4 s of CPU)
    return ClassRun(
        repos,
        out,
        _options(args),
        jobs=1 if alone else args.jobs,
        force=args.force,
        gpus=gpus,
        gpu_models=models,
        alone=alone,
    )


def _gpus() -> tuple[int, list[str]]:
    """The GPUs this process sees, and their models (torch is imported only where a GPU is present)."""
    if not _gpu_present():
        return 0, []
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpus, [torch.cuda.get_device_name(i) for i in range(gpus)]


def _out(args: argparse.Namespace) -> Path:
    return (args.out or SUITE_ROOT / "runs" / "grades").resolve()


def grade_one(args: argparse.Namespace, repos: dict[str, Path]) -> int:
    """One repository, through the same job as a class (its time limit, progress lines and process
    cleanup), its results kept in ``DIR/<name>/``; printing its log, where the results are, and its hook
    x tier table last. With ``--out``, the class report of that folder too."""
    (name,) = repos
    out = _out(args)
    run = _class_run(args, repos, out, alone=True)
    run.run()
    if args.out is not None:
        from cs336_systems.grading.class_run import class_report

        written, _ = class_report.write(out, list(repos))
        print(f"class report: {written['md']}, {written['csv']}, {written['html']}")
    return _say_repository(args, out / name, run.codes.get(name))


def _say_repository(args: argparse.Namespace, folder: Path, code: int | str | None) -> int:
    """A graded repository's log, its isolation, where its results are, and its table (the last thing
    printed); its exit status (``code``: its job's; None: the one its results give, as when they were
    up to date)."""
    from cs336_systems.grading.judge import summary

    report = json.loads((folder / "grade.json").read_text()) if (folder / "grade.json").is_file() else None
    failure = (folder / "failure.txt").read_text().strip() if (folder / "failure.txt").is_file() else None
    if report is None or failure:
        print(f"{PROG}: {failure or 'grading failed'}", file=sys.stderr)
        return 2
    if args.grade_json:
        args.grade_json.parent.mkdir(parents=True, exist_ok=True)
        args.grade_json.write_text(json.dumps(report, indent=2))
    log = (folder / "contract.log").read_text() if (folder / "contract.log").is_file() else ""
    print(log.rstrip())
    if report.get("isolation"):
        from cs336_systems.grading.sandbox import describe

        print(describe(report["isolation"]))
    if report.get("walls"):
        from cs336_systems.grading.walls import describe as walls_line

        print(walls_line(report["walls"]))
    _print_report(report, folder)
    if code is None:  # up to date: the status its results give
        return summary.exit_status(report, True, 0)
    return code if isinstance(code, int) else 2


def _print_report(report: dict, folder: Path) -> None:
    from cs336_systems.grading.class_run import class_report, course_report
    from cs336_systems.grading.judge import summary

    lb = report.get("leaderboard")
    if lb:
        shown = (
            f"{lb['mean_ms']:.3f} ms"
            if isinstance(lb.get("mean_ms"), int | float)
            else lb.get("error", "not timed")
        )
        rank = "ranked" if lb.get("ranked") else f"no rank: {lb.get('unranked_because')}"
        print(
            f"leaderboard (course protocol): {shown}, {'compiled' if lb.get('compiled') else 'eager'}; {rank}"
        )
    for line in course_report.course_test_lines(report):
        print(line)
    results = class_report.load(folder / "results.json") or {}
    print(f"results: {folder}/ (grade.json: every case and its message; results.json: Gradescope's)")
    print(f"score: {class_report.score_text(results)} (results.json's points)")
    print()
    for line in summary.render(report):
        print(line)


def _executor_run(args: argparse.Namespace, repos: dict[str, Path], out: Path) -> dict[str, str]:
    """The class as one job per repository (``--executor``), through submitit."""
    import torch

    from cs336_systems.grading.class_run.class_executor import ClassJobs, config_for_class, run_class

    local_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    config = config_for_class(args, len(repos), local_gpus, out / "jobs")
    # Each job's GPUs are its workers' (4 side by side with one), as in a one-machine run.
    args.workers = args.workers or (4 if config.gpus_per_job else 1)
    jobs = ClassJobs(repos, out, _options(args), config, args.force, local_gpus)
    return run_class(jobs, say=lambda line: print(line, flush=True))


def grade_class(args: argparse.Namespace, repos: dict[str, Path]) -> int:
    from cs336_systems.grading.class_run import class_report

    out = _out(args)
    _say_isolation(args)
    if not _walls_hold(args, repos, out):
        return 2
    if args.executor:
        try:
            outcomes = _executor_run(args, repos, out)
        except ExecutorError as exc:
            print(f"{PROG}: {exc}", file=sys.stderr)
            return 2
    else:
        outcomes = _class_run(args, repos, out).run()
    written, table = class_report.write(out, list(repos))
    print(f"\nclass report: {written['md']}, {written['csv']}, {written['html']}")
    print(table)
    if len(repos) == 1:  # one repository (through --executor) ends with its own table, as alone
        (name,) = repos
        return _say_repository(args, out / name, None)
    failed = [n for n, o in outcomes.items() if o.startswith("grading failed")]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
