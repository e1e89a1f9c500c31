"""Grading a class: many repositories side by side, each in a process of its own (``repo_job``).

One GPU per repository while GPUs last (``CUDA_VISIBLE_DEVICES``); on a machine without one, ``--jobs``
repositories at a time with the cores split between them. Each repository has a time limit: one that
crashes, hangs or runs out of memory gets that verdict in its ``results.json`` and never stops the
others. A repository whose ``results.json`` is newer than every file of its code is not graded again
(``force`` regrades), unless that file only says why its grading did not finish (timed out, cancelled,
died: ``unfinished.txt`` beside it). SIGINT or SIGTERM stops the repositories being graded, records
them as cancelled, and ends the run (``Interrupted``); those already graded are kept. With ``bench``, the suite's kernel and cuDNN are timed once on each model of GPU
the run has (``anchors/gpu<i>.json``, on the first of them to have no repository left), beside which the
class report ranks the students' rows. Once per GPU would add a whole job to the end of every GPU's
queue, to catch a spread between cards of one model smaller than the band a row is judged in (both
measured: docs/grading.md).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from cs336_systems.jobs.executor import visible_devices
from cs336_systems.jobs.interrupt import Interrupted, catching_stops

from .. import gradescope, walls
from ..progress import partial_report, progress_line
from ..repo.leaderboard import observer_turn
from ..roots import SKIP_DIRS, GradingSetupError
from ..sandbox import become_subreaper, kill_descendants
from ..settings import HIDE_ENV

if TYPE_CHECKING:  # the CLI checks its targets with repositories() before torch is imported
    from ..repo.repo_job import RepoOptions


POLL_S = 0.5  # seconds between two looks at the running jobs
PROGRESS_S = 15.0  # seconds between two progress lines of one repository
UP_TO_DATE = "up to date (results.json newer than its code, graded with the same selection; --force regrades)"
UNFINISHED = "unfinished.txt"  # beside a results.json the class run wrote for a grading that did not finish
ANCHORS_WORK = "timing the suite's kernel and cuDNN"  # an anchors job's progress line (it grades no case)


def repositories(targets: list[Path]) -> dict[str, Path]:
    """Name -> path: each target that is a repository (holds tests/adapters.py) or an adapters file;
    a folder that is neither stands for the repositories directly inside it, and holding none is an
    error (``GradingSetupError``), as is a target that does not exist."""
    found: list[Path] = []
    for target in targets:
        target = target.expanduser().resolve()
        if not target.exists():
            raise GradingSetupError(f"{target}: no such file or folder")
        if target.is_file() or (target / "tests" / "adapters.py").is_file():
            found.append(target)
            continue
        inside = sorted(p for p in target.iterdir() if (p / "tests" / "adapters.py").is_file())
        if not inside:
            raise GradingSetupError(
                f"{target} has no tests/adapters.py, nor does any folder directly inside it: the grader "
                "calls the course's hooks there (point it at a repository, an adapters file, or a folder "
                "of repositories)"
            )
        found += inside
    names: dict[str, Path] = {}
    for path in found:
        base = _name_of(path)
        name, n = base, 2
        while name in names:
            name, n = f"{base}-{n}", n + 1
        names[name] = path
    return names


def _name_of(target: Path) -> str:
    """A repository's folder name; an adapters file other than ``adapters.py`` adds its own stem, so that
    several adapters files of one repository (a fixture's variants) are told apart in the table."""
    if not target.is_file():
        return target.name
    repo = target.parent.parent.name
    variant = target.stem.removeprefix("adapters").lstrip("_")
    return f"{repo}-{variant}" if variant else repo


def newest_code(repo: Path) -> float:
    """The newest modification time of a repository's code (Python files and pyproject.toml)."""
    root = repo.parent.parent if repo.is_file() else repo
    newest = 0.0
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        for f in files:
            if f.endswith((".py", ".toml")):
                newest = max(newest, (Path(folder) / f).stat().st_mtime)
    return newest


def to_grade(
    repos: dict[str, Path], out: Path, options: RepoOptions, force: bool, say: Callable[[str], None]
) -> tuple[dict[str, Path], dict[str, str]]:
    """The repositories to grade (all with ``force``), and the outcome of the others (up to date), each
    said: both schedulers, processes here and jobs, skip the same ones with the same line."""
    todo = {n: p for n, p in repos.items() if force or not up_to_date(p, out / n, options)}
    kept = {n: UP_TO_DATE for n in repos if n not in todo}
    for name, outcome in kept.items():
        say(f"[{name}] {outcome}")
    return todo, kept


def up_to_date(repo: Path, out: Path, options: RepoOptions) -> bool:
    """Whether the repository's results answer this run: newer than its code (and than the points
    table), graded with the same selection (``SELECTION``: the tiers, ``-k``, ``--bench``, the points,
    the course's tests, the seed and roots asked for), and a grading's (not the record of one that was
    cancelled, timed out or died: the next run grades it again)."""
    results = out / "results.json"
    if not results.is_file() or (out / UNFINISHED).is_file():
        return False
    points = options.points if options.points and Path(options.points).is_file() else None
    newest = max(newest_code(repo), Path(points).stat().st_mtime if points else 0.0)
    return results.stat().st_mtime > newest and same_selection(out / "options.json", options)


# The options that decide which cases are graded and how they score; the others (workers, time limit,
# worker user) change how a grading runs, not its results.
SELECTION = ("tiers", "seed", "course_tests", "bench", "points", "roots", "judge_args")


def options_json(options: RepoOptions) -> dict:
    """``options`` as ``options.json`` holds them (what ``repo_job --options`` reads)."""
    raw = dataclasses.asdict(options)
    raw["roots"] = [str(r) if r else None for r in raw["roots"]]
    raw["points"] = str(raw["points"]) if raw["points"] else None
    return json.loads(json.dumps(raw))  # tuples as the file has them: lists


def same_selection(path: Path, options: RepoOptions) -> bool:
    """Whether the results beside ``path`` (``options.json``) were graded with ``options``' selection."""
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return False  # results without their options: of an unknown selection
    now = options_json(options)
    return isinstance(stored, dict) and all(stored.get(k) == now.get(k) for k in SELECTION)


@dataclass
class Running:
    name: str
    proc: subprocess.Popen
    started: float
    gpu: int | None
    out: Path
    progress_at: float = 0.0


@dataclass
class ClassRun:
    repos: dict[str, Path]
    out: Path
    options: RepoOptions  # its ``limits`` hold each repository's time limit (``--timeout``)
    jobs: int | None = None
    force: bool = False
    gpus: int = 0
    log: object = field(default=sys.stdout)
    gpu_models: list[str] = field(default_factory=list)  # each GPU's name, by index (default: all alike)
    codes: dict[str, int | str] = field(default_factory=dict)  # each job's exit status, or "timeout"
    alone: bool = False  # one repository: its caller prints why grading failed, once, after the run

    def slots(self) -> list[int | None]:
        if self.gpus:
            return list(range(self.gpus))
        return [None] * max(1, self.jobs or max(1, (os.cpu_count() or 2) // 2))

    def _spawn(self, name: str, target: Path, gpu: int | None, threads: int) -> Running:
        out, options = prepare_repo(self.out, name, self.options)
        env = repo_env(threads, gpu, neighbours(self.repos, name))
        return start_job(name, repo_command(target, out, options), env, out / "job.log", gpu, out)

    def _anchor(self, gpu: int) -> Running:
        out = self.out / "anchors"
        out.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=visible_devices([gpu]))
        cmd = anchor_command(out / f"gpu{gpu}.json")
        return start_job(f"anchors (gpu {gpu})", cmd, env, out / f"gpu{gpu}.log", gpu, out)

    def run(self) -> dict[str, str]:
        """Grade every repository; each one's outcome (graded, up to date, or why grading failed)."""
        pending, outcomes = to_grade(self.repos, self.out, self.options, self.force, self._say)
        todo = list(pending.items())  # taken from the front as slots free
        free = self.slots()
        threads = max(1, (os.cpu_count() or 2) // len(free))
        models = self.gpu_models or ["gpu"] * self.gpus
        anchors = sorted(set(models)) if self.options.bench and todo and self.gpus else []
        if anchors:
            anchors_folder(self.out)
        running: list[Running] = []
        become_subreaper()  # what a job that died left behind comes here, and is killed below
        wire = walls.Tripwire(walls.watched(list(self.repos.values()))) if todo else None
        started = time.monotonic()
        with catching_stops() as stops:
            while todo or running or anchors:
                self._start_next(free, todo, anchors, models, running, threads)
                if stops.sleep(POLL_S):
                    raise self._interrupt(stops.signum or signal.SIGINT, running, outcomes, len(todo))
                done = self._collect(running, free, outcomes)
                if done and wire and (changed := wire.changed()):
                    self._distrust(changed, done, running, [n for n, _ in todo], outcomes)
                    break
        many = "repository" if len(self.repos) == 1 else "repositories"
        self._say(f"{len(self.repos)} {many} in {time.monotonic() - started:.0f} s")
        return outcomes

    def _start_next(
        self,
        free: list[int | None],
        todo: list[tuple[str, Path]],
        anchors: list[str],
        models: list[str],
        running: list[Running],
        threads: int,
    ) -> None:
        """Students first; the first GPU of each model with no student left times the anchors."""
        while free and (todo or anchors):
            slot = free.pop(0)
            if todo:
                name, target = todo.pop(0)
                running.append(self._spawn(name, target, slot, threads))
                self._say(f"[{name}] started" + (f" on GPU {slot}" if slot is not None else ""))
            elif slot is not None and models[slot] in anchors:
                anchors.remove(models[slot])
                running.append(self._anchor(slot))

    def _collect(
        self, running: list[Running], free: list[int | None], outcomes: dict[str, str]
    ) -> list[Running]:
        """The jobs that ended (returned): their outcomes, their slots freed, what they left behind
        killed."""
        done = [job for job in running if self._finished(job, outcomes)]
        for job in done:
            running.remove(job)
            free.append(job.gpu)
        if done:  # orphans re-parented here; the running jobs' trees are theirs
            kill_descendants(keep=frozenset(j.proc.pid for j in running))
        return done

    def _interrupt(
        self, signum: int, running: list[Running], outcomes: dict[str, str], not_started: int
    ) -> Interrupted:
        """Stop every running job with all it started; each repository among them is recorded as
        cancelled (graded again by the next run). One that ended meanwhile keeps its own outcome."""
        stopped = Interrupted(signum)
        self._collect(running, [], outcomes)
        for job in running:
            finished = graded(job.out)  # read before the stop: what a job writes as it dies is not results
            stop(job.proc)
            if job.name.startswith("anchors"):
                continue
            elapsed = time.monotonic() - job.started
            if finished:
                outcomes[job.name] = (
                    f"graded in {elapsed:.0f} s (stopped by {stopped.name} after its results)"
                )
            else:
                why = f"cancelled after {elapsed:.0f} s: the run was interrupted by {stopped.name}"
                outcomes[job.name] = record_failure(job.out, why, self.options.points)
                stopped.cancelled += 1
            self._say(f"[{job.name}] {outcomes[job.name]}")
        kill_descendants()
        stopped.kept, stopped.not_started = len(outcomes) - stopped.cancelled, not_started
        return stopped

    def _finished(self, job: Running, outcomes: dict[str, str]) -> bool:
        elapsed = time.monotonic() - job.started
        code = job.proc.poll()
        if code is None and past_limit(job.started, self.options.limits.repository_s, job.out):
            stop(job.proc)
            code = "timeout"
        anchors = job.name.startswith("anchors")  # grades no case: neither progress lines nor an outcome
        if code is None:
            if time.monotonic() - job.progress_at > PROGRESS_S:
                job.progress_at = time.monotonic()
                doing = ANCHORS_WORK if anchors else progress_line(job.out / "progress.jsonl")
                self._say(f"[{job.name}] {doing}, {elapsed:.0f} s")
            return False
        if anchors:
            return True
        self.codes[job.name] = code
        outcomes[job.name] = self._outcome(job, code, elapsed)
        failed = self.alone and outcomes[job.name].startswith("grading failed")
        self._say(f"[{job.name}] {'grading failed (below)' if failed else outcomes[job.name]}")
        return True

    def _distrust(
        self,
        changed: list[str],
        done: list[Running],
        running: list[Running],
        waiting: list[str],
        outcomes: dict,
    ) -> None:
        """Some graded code wrote outside its scratch: the repositories that ran meanwhile cannot be
        trusted, the others are not graded on a changed environment; the class stops here."""
        wrote = changed[0] + (f" (and {len(changed) - 1} more)" if len(changed) > 1 else "")
        ran = [j for j in [*done, *running] if not j.name.startswith("anchors")]
        for job in running:
            stop(job.proc)
        for job in ran:
            outcomes[job.name] = distrust(
                job.out, f"could not be trusted: wrote {wrote}", self.options.points
            )
        for name in waiting:
            outcomes[name] = f"grading failed: not graded, the class stopped ({wrote} changed)"
        names = ", ".join(j.name for j in ran)
        self._say(f"class stopped: {wrote} changed while {names} ran; no repository is graded on it")

    def _outcome(self, job: Running, code: int | str, elapsed: float) -> str:
        return job_outcome(job.out, code, elapsed, self.options.limits.repository_s, self.options.points)

    def _say(self, line: str) -> None:
        print(line, file=self.log, flush=True)


def anchors_folder(out_root: Path) -> Path:
    """``OUT/anchors``, an earlier run's anchors (perhaps of other GPU models) removed: the class report
    reads every ``gpu<i>.json`` there."""
    folder = out_root / "anchors"
    folder.mkdir(parents=True, exist_ok=True)
    for stale in folder.glob("gpu*"):
        stale.unlink()
    return folder


def prepare_repo(out_root: Path, name: str, options: RepoOptions) -> tuple[Path, Path]:
    """A repository's folder cleared of an earlier run's results, with its options written: the folder
    and the options file (``repo_job --options``)."""
    out = out_root / name
    out.mkdir(parents=True, exist_ok=True)
    for stale in (
        "grade.json",
        "results.json",
        "progress.jsonl",
        "failure.txt",
        "leaderboard.json",
        UNFINISHED,
    ):
        (out / stale).unlink(missing_ok=True)
    path = out / "options.json"
    path.write_text(json.dumps(options_json(options)))
    return out, path


def repo_command(target: Path, out: Path, options: Path) -> list[str]:
    """The process that grades one repository."""
    cmd = [sys.executable, "-m", "cs336_systems.grading.repo.repo_job", str(target)]
    return [*cmd, "--out", str(out), "--options", str(options)]


def anchor_command(json_path: Path) -> list[str]:
    """The process that times the suite's kernel and cuDNN on the GPU it sees."""
    return [sys.executable, "-m", "cs336_systems.grading.repo.leaderboard.row", "--json", str(json_path)]


def neighbours(repos: dict[str, Path], name: str) -> list[Path]:
    """The folders of every other repository of the class (its workers see none of them)."""
    own = set(walls.trees(repos[name])) if name in repos else set()
    return [p for n, target in repos.items() if n != name for p in walls.trees(target) if p not in own]


def repo_env(threads: int, gpu: int | None, hidden: list[Path]) -> dict[str, str]:
    """The grading process's environment: its threads, the class's other repositories (hidden from its
    workers), no bytecode written (the tripwire reads any new ``.pyc`` as graded code's), and its GPU
    (``None``: the one this process was given, e.g. by Slurm)."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONDONTWRITEBYTECODE="1")
    env[HIDE_ENV] = os.pathsep.join(str(p) for p in hidden)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices([gpu])  # GPU ``gpu`` of those this process sees
    return env


def past_limit(started: float, limit_s: float, out: Path) -> bool:
    """Whether a job started at ``started`` (monotonic) ran ``limit_s`` beyond its waits for this host's
    observer (``observer_turn``): a repository is not stopped for time spent behind another's. Both
    schedulers stop a job by this rule."""
    return time.monotonic() - started > limit_s + observer_turn.waited_s(out)


def job_outcome(out: Path, code: int | str, elapsed: float, timeout: float, points: Path | None) -> str:
    """One line on how a repository's grading process ended (``code``: its exit status or
    ``"timeout"``); one that left no results gets them here, with a visible "grader failed"."""
    if code == "timeout" or not (out / "results.json").is_file():
        why = (
            f"timed out after {timeout:.0f} s"
            if code == "timeout"
            else f"the grading process died (exit {code}): {_tail(out / 'job.log')}"
        )
        return record_failure(out, why, points)
    failure = out / "failure.txt"
    if failure.is_file():
        return f"grading failed: {failure.read_text().strip()}"
    return f"graded in {elapsed:.0f} s (exit {code})"


def distrust(out: Path, why: str, points: Path | None) -> str:
    """A repository graded while something wrote outside the walls: no score of it stands, and the next
    run grades it again."""
    gradescope.write(out / "results.json", gradescope.results(None, gradescope.load_points(points), why))
    (out / "failure.txt").write_text(why + "\n")
    (out / UNFINISHED).write_text(why + "\n")
    return f"grading failed: {why}"


def graded(out: Path) -> bool:
    """Whether this run's grading process wrote its results (``results.json`` is its last file; an
    earlier run's is removed before it starts), so that a cancel arriving after them keeps them."""
    try:
        json.loads((out / "results.json").read_text())
    except (OSError, ValueError):
        return False
    return not (out / UNFINISHED).is_file()


def record_failure(out: Path, why: str, points: Path | None) -> str:
    """A repository whose grading did not finish (timed out, cancelled, died, its job failed): its
    ``results.json`` (the cases graded before, and "grader failed" saying why), ``failure.txt``, and
    ``unfinished.txt``, which keeps the next run from taking these results as up to date."""
    partial = partial_report(out / "progress.jsonl")
    gradescope.write(out / "results.json", gradescope.results(partial, gradescope.load_points(points), why))
    (out / "failure.txt").write_text(why + "\n")
    (out / UNFINISHED).write_text(why + "\n")
    return f"grading failed: {why}"


def stop(proc: subprocess.Popen) -> None:
    """Stop a job with everything it started: its process group, and every descendant (a process that
    left the group with ``setsid`` included: the job is a subreaper, so they are all below it). The job is
    frozen first: running while its children die, it could take their deaths for a failure and write it."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)
    kill_descendants(root=proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):  # a job that leads no group of its own: frozen till now
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait()  # what it left since is re-parented to this process: the run's loop kills it


def start_job(name: str, cmd: list[str], env: dict, log: Path, gpu: int | None, out: Path) -> Running:
    """A job in a process group of its own (a time limit stops it with everything it started)."""
    with log.open("w") as f:
        proc = subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
    return Running(name, proc, time.monotonic(), gpu, out)


def _tail(log: Path) -> str:
    from ..exchange import text

    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.is_file() else []
    return text(lines[-1], 300) if lines else "(no output)"
