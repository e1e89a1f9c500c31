"""Grading one repository into a folder of its own: what a class run does for each repository, in a
process of its own (``python -m cs336_systems.grading.repo.repo_job --out DIR TARGET``).

The folder gets ``grade.json`` (every case's verdict and message, the seed), ``results.json``
(Gradescope's format, written even when grading fails), ``contract.log`` and ``progress.jsonl`` (one
line per graded case, which the class run reads for its progress lines), and with ``--bench``
``leaderboard.json``: the 2025 leaderboard case timed on this side's clock over iterations it verifies,
observed from outside where the machine can, and whether it may be ranked (``leaderboard/``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# No import here may start a thread (torch's does: ``course_tests``, ``exchange`` are imported where
# used): ``main`` first moves this process to a network of its own, which must be its only thread.
from .. import caches, gradescope, network, progress
from ..access import worker_cannot_read
from ..limits import Limits
from ..probe import syntax_problem
from ..roots import SUITE_ROOT, GradingSetupError, StudentRoots, discover
from ..sandbox import become_subreaper, kill_descendants
from ..settings import LOADED_ENV, SCRATCH_ENV, WORKER_USER_ENV, namespaces_wanted
from ..shared.cases import TRITON_HOOK
from .leaderboard import observer_turn

MIN_ROW_S = 60.0  # a leaderboard row needs at least this (a compile, the course's do_bench, the rounds)


@dataclass
class RepoOptions:
    tiers: str | None = None
    seed: int | None = None
    course_tests: str | None = None  # "own", a release's tests/ folder, or None
    bench: bool = False
    points: Path | None = None
    workers: int = 1
    roots: tuple[Path | None, Path | None, Path | None] = (None, None, None)  # repo, package, basics
    judge_args: tuple[str, ...] = ()  # more arguments of the judge: the case selection, -k EXPR
    worker_user: str | None = None  # run the graded code as this user when grading as root
    limits: Limits = field(default_factory=Limits)  # ``--timeout`` and each inner piece's share of it


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


def contract_command(adapters: Path, opts: RepoOptions, out: Path) -> list[str]:
    """The judging process of this repository (``grading/judge/judging.py``), from the package: no ``tests/``
    folder needed. ``--grade-json=PATH`` in one argument, as a left-behind process would look for it."""
    cmd = [sys.executable, "-m", "cs336_systems.grading.judge", f"--adapters={adapters}"]
    cmd += [f"--grade-json={out / 'grade.json'}", f"--grade-progress={out / 'progress.jsonl'}"]
    cmd += ["--grade-summary=none"]
    for flag, value in zip(("--repo-root", "--package-root", "--basics-root"), opts.roots, strict=True):
        if value is not None:
            cmd.append(f"{flag}={Path(value).resolve()}")
    if opts.seed is not None:
        cmd.append(f"--grade-seed={opts.seed}")
    if opts.tiers:
        cmd.append(f"--grade-tiers={opts.tiers}")
    cmd.append(f"--grade-jobs={opts.workers}")
    cmd.append(f"--grade-timeout={opts.limits.repository_s}")
    return cmd + list(opts.judge_args)


def grade_repo(target: Path, out: Path, opts: RepoOptions) -> int:
    """Grade ``target`` into ``out``; the exit status of a one-repository run (0 course ok, 1 a course
    failure or a case that cannot be graded, 2 the repository cannot be graded at all)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "grade.json").unlink(missing_ok=True)  # only this run's judge may leave one
    (out / observer_turn.WAIT_FILE).unlink(missing_ok=True)  # this run's waits alone extend its limit
    points = gradescope.load_points(opts.points)
    try:
        adapters = adapters_of(target.expanduser().resolve())
        roots = discover(adapters, *opts.roots)
    except GradingSetupError as exc:
        return _failed(out, points, f"cannot grade: {exc}")
    if opts.worker_user and (why := worker_cannot_read(opts.worker_user, roots.folders())):
        return _failed(out, points, f"cannot grade: {why}")  # the grader's setup: no case is the code's
    # Whatever the graded code leaves behind is re-parented here, and killed before any result file
    # of this repository is read or written (``reap``).
    become_subreaper()
    if why := syntax_problem(roots.adapters):  # no worker started for a file that cannot load
        return _failed(out, points, f"cannot grade: {why}", parses=False)
    with repository_sandbox(opts):
        return _grade(roots, adapters, out, opts, points)


def _grade(roots: StudentRoots, adapters: Path, out: Path, opts: RepoOptions, points: dict) -> int:
    """The judge, then the course tests and the leaderboard where asked: ``grade.json`` and
    ``results.json``; the exit status as ``grade_repo``'s."""
    began = started = time.monotonic()
    held = walls_here(out)
    # No load check of its own before the cases: every job loads the file, and one that cannot makes
    # every case an error of kind "load" (read back below), without a process start on the way.
    env = {**os.environ, LOADED_ENV: str(roots.adapters)}
    # The judge hosts its jobs' rendezvous store: on a network with loopback only, every rank's connection
    # logged "[c10d] The hostname of the client socket cannot be retrieved" in the middle of its marks.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    with (out / "contract.log").open("w") as log:
        code = subprocess.call(
            contract_command(adapters, opts, out),
            cwd=SUITE_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    seconds = {"contract": round(time.monotonic() - started, 1)}
    reap()
    if not (out / "grade.json").is_file():
        return _failed(
            out, points, _last_line(out / "contract.log") or f"the contract run exited with {code}"
        )
    report = json.loads((out / "grade.json").read_text())
    if why := _load_failure(report):
        (out / "grade.json").unlink()
        return _failed(out, points, f"cannot grade {roots.adapters}: {why}", syntax_problem(adapters) is None)
    if opts.course_tests:
        from . import course_tests

        given = None if opts.course_tests == "own" else Path(opts.course_tests).resolve()
        started = time.monotonic()
        with _phase(out, "course-tests", "the course's tests (pytest on its adapters file)"):
            try:
                release = course_tests.release_for(roots, given)
                report["course_tests"] = course_tests.run(roots, release, opts.limits.course_tests_s)
            except GradingSetupError as exc:
                report["course_tests"] = {}
                report["course_tests_error"] = str(exc)
        seconds["course_tests"] = round(time.monotonic() - started, 1)
        report["agreement"] = course_tests.agreement(
            report["course_tests"], report["groups"], report["cases"]
        )
    if opts.bench:
        budget = opts.limits.repository_s - (time.monotonic() - began) - opts.limits.reserve_s
        started = time.monotonic()
        with _phase(out, "leaderboard", "the leaderboard row (the course's protocol, timed and observed)"):
            report["leaderboard"] = _leaderboard_or_why_not(roots, adapters, report, out, budget, opts.limits)
        seconds["bench"] = round(time.monotonic() - started, 1)
        (out / "leaderboard.json").write_text(json.dumps(report["leaderboard"], indent=2))
    report["seconds"] = seconds
    report["limits"] = opts.limits.as_dict()
    report["walls"] = held
    reap()  # the course tests and the bench ran the graded code too
    (out / "grade.json").write_text(json.dumps(report, indent=2))
    gradescope.write(out / "results.json", gradescope.results(report, points))
    from ..judge.summary import exit_status

    return exit_status(report, not roots.self_grade, code)


@contextlib.contextmanager
def _phase(out: Path, key: str, doing: str) -> Iterator[None]:
    """Say in ``progress.jsonl`` what runs now, and that it ended (the class run's progress line)."""
    progress.phase(out / "progress.jsonl", progress.START, key, doing)
    try:
        yield
    finally:
        progress.phase(out / "progress.jsonl", progress.END, key, "")


@contextlib.contextmanager
def repository_sandbox(opts: RepoOptions) -> Iterator[Path]:
    """The sandbox of everything that runs this repository's code, here and in the judge it starts (the
    judge's workers, the course tests, the leaderboard): the user they run as, and this repository's
    scratch (its ``HOME`` and compile caches), never another repository's nor the anchors'. Removed
    with its job."""
    folder = Path(tempfile.mkdtemp(prefix="cs336-repo-"))
    folder.chmod(0o711)  # a worker user reaches its own folders inside, and lists nothing
    caches.seed_scratch(folder)
    os.environ[SCRATCH_ENV] = str(folder)
    if opts.worker_user:
        os.environ[WORKER_USER_ENV] = opts.worker_user
    try:
        yield folder
    finally:
        os.environ.pop(SCRATCH_ENV, None)
        os.environ.pop(WORKER_USER_ENV, None)
        shutil.rmtree(folder, ignore_errors=True)


def walls_here(out: Path) -> dict[str, str]:
    """What a worker of this repository can write, probed as it starts (``walls.py``): the class's
    other repositories, the grading environment, the suite, the results, the grader's home and caches."""
    from .. import walls
    from ..sandbox import Sandbox

    sandbox = Sandbox.from_env()
    return walls.probe(sandbox, walls.places(list(sandbox.hidden), [out, out.parent]))


def reap() -> None:
    """Kill every process the graded code left (this process is their subreaper); say so if any
    survives, since the results written next could be rewritten by it."""
    if left := kill_descendants():
        print(f"warning: processes {left} of the graded code survived SIGKILL", file=sys.stderr)


def _load_failure(report: dict) -> str | None:
    """Why the adapters file did not load, when no case could run for that reason."""
    graded = [c for c in report.get("cases", []) if c.get("status") != "skipped"]
    if graded and all(c.get("kind") == "load" for c in graded):
        return graded[0].get("message") or "the adapters file did not load"
    return None


def _leaderboard_or_why_not(
    roots: StudentRoots, adapters: Path, report: dict, out: Path, budget_s: float, limits: Limits
) -> dict[str, Any]:
    import torch

    from ..probe import probe
    from .leaderboard.clock import ClockPlan
    from .leaderboard.row import row

    blank = probe(adapters).reason(TRITON_HOOK)
    if blank:
        return {"error": blank, "ranked": False, "unranked_because": "not implemented"}
    if not torch.cuda.is_available():
        return {
            "error": "needs a CUDA GPU (none here): not timed",
            "ranked": False,
            "unranked_because": "not timed",
        }
    if budget_s < MIN_ROW_S:
        why = f"not timed: {max(0.0, budget_s):.0f} s of the repository's time limit were left for it"
        return {"error": why, "ranked": False, "unranked_because": "not timed"}
    lock, record = observer_turn.lock_path(out.parent), out / observer_turn.WAIT_FILE
    plan = ClockPlan(wait_s=limits.leaderboard_wait_s)
    return row(roots, report, plan, lock=lock, wait_record=record, budget_s=budget_s)


def _failed(out: Path, points: dict, why: str, parses: bool = True) -> int:
    doc = gradescope.results(None, points, why) if parses else gradescope.students_error(why, points)
    gradescope.write(out / "results.json", doc)
    (out / "failure.txt").write_text(why + "\n")
    return 2


def _last_line(log: Path) -> str:
    from ..exchange import text

    lines = [ln.strip() for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    return text(
        next(
            (ln for ln in reversed(lines) if "cannot grade" in ln or "ERROR" in ln),
            lines[-1] if lines else "",
        )
    )


def main(argv: list[str] | None = None) -> int:
    # First, while this is the process's only thread: the judge, its stores and workers, the course's
    # tests and the leaderboard all start below, on this repository's network alone.
    network.isolate(namespaces_wanted())
    p = argparse.ArgumentParser(prog="python -m cs336_systems.grading.repo.repo_job", description=__doc__)
    p.add_argument("target", type=Path)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--options", type=Path, required=True, help="the RepoOptions of the class run, as JSON")
    args = p.parse_args(argv)
    return grade_repo(args.target, args.out, options_of(json.loads(args.options.read_text())))


def options_of(raw: dict) -> RepoOptions:
    """The class run's ``options.json`` (``classroom.options_json``) as the options it was written from."""
    raw = dict(raw)
    raw["roots"] = tuple(Path(r) if r else None for r in raw.get("roots", (None, None, None)))
    raw["points"] = Path(raw["points"]) if raw.get("points") else None
    raw["judge_args"] = tuple(raw.get("judge_args", ()))
    raw["limits"] = Limits(**raw.get("limits", {}))
    return RepoOptions(**raw)


if __name__ == "__main__":
    sys.exit(main())
