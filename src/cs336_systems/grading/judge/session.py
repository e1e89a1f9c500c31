"""One grading run of one adapters file: the run's seed, each case's inputs, the workers' outcomes and
the verdicts, decided here from validated records (``judge``), never by the graded process.

Before any worker starts, a case skips when a hook it needs is blank in the file's source (``probe``:
``not-implemented``) or when it needs a GPU this machine lacks (``needs-gpu``), and fails when the
file's module-level imports reach one found nowhere (``imports``: the student's error; a dependency the
repository declares is the grading environment's, as below). A case whose record says
the call raised fails with where it raised, except a missing dependency of the student's code, which is
an error of the grading environment named once (``missing-dependency``), and a Triton kernel that
refuses CPU tensors before launching anything (``refuses-cpu``, decided by the attention judge).
"""

from __future__ import annotations

import hashlib
import os
import secrets
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .. import progress
from ..exchange import text
from ..limits import Limits
from ..probe import Probe
from ..roots import GradingSetupError, StudentRoots
from ..settings import share_seed, shared_seed
from ..shared.cases import CASES, NEEDS_GPU, NOT_IMPLEMENTED, UNFINISHED_HERE, Case
from ..verdict import FAILED, MISSING_DEPENDENCY, Verdict
from . import attention, families
from .imports import DECLARED, NO_BASICS, missing_import
from .runner import JOB_ENDED, JOB_STARTS, CaseRuns, Job, Machine, Outcome, run

IMPORT_FAILED = "import"  # a failure's kind: the adapters file imports what is nowhere (read from source)


def fresh_seed() -> int:
    return secrets.randbelow(2**31)


def run_seed(asked: int | None) -> int:
    """The run's seed: the one asked for, else the one an earlier process of this run drew (pytest-xdist
    workers, a class run's jobs), else a fresh one; shared with this run's later processes."""
    seed = asked if asked is not None else shared_seed()
    seed = fresh_seed() if seed is None else seed
    share_seed(seed)
    return seed


def default_jobs() -> int:
    """Worker jobs side by side when none are asked for: 4 with a GPU, else half the cores up to 4."""
    return 4 if torch.cuda.is_available() else max(1, min(4, (os.cpu_count() or 1) // 2))


def check_loads(roots: StudentRoots, limits: Limits) -> None:
    """One worker imports the adapters file, within its share of ``limits``; one line
    (``GradingSetupError``) when it cannot."""
    got = run(Job(roots, "load", timeout=limits.load_s))
    record = got.records.get(("load", 0))
    if got.job_problem is None and record is not None and record.get("status") == "loaded":
        return
    if got.job_problem:
        why = got.job_problem
    elif record is not None and record.get("status") == "load-error":
        why = record.get("message")
    elif record is not None:
        why = f"the load check's record was rewritten (status {record.get('status')!r}, not 'loaded')"
    else:
        why = got.problems.get(("load", 0), "no record of the load check")
    raise GradingSetupError(f"cannot grade {roots.adapters}: {why}")


@dataclass
class Grader:
    """Judges cases; their jobs (``batch_key``: one per family and world size) run one at a time as
    their first case is judged, or, with ``jobs`` > 1, all started by ``plan`` and run that many side by
    side, so that a job's process start, imports and Triton compiles overlap the others'."""

    roots: StudentRoots
    probe: Probe
    seed: int
    timeout: float
    on_gpu: bool = field(default_factory=torch.cuda.is_available)
    jobs: int = 1
    machine: Machine = field(default_factory=Machine)
    progress: Path | None = None  # where each job's start, rerun and end is said (``progress.py``)

    def __post_init__(self) -> None:
        self.unloadable = load_verdict(self.roots)  # read from the source: no worker starts for it
        self.runs = CaseRuns(self.roots, self.timeout, machine=self.machine, on_job=self._job_phase)
        self._inputs: dict[str, dict] = {}
        self._drawing = threading.Lock()  # inputs are drawn one at a time: some makers seed torch's RNG
        self._batches: dict[tuple, list[str]] = {}
        self._started: dict[tuple, Future] = {}
        self._pool: ThreadPoolExecutor | None = None

    def inputs(self, case_id: str) -> dict[str, Any]:
        with self._drawing:
            if case_id not in self._inputs:
                digest = hashlib.sha256(f"{self.seed}/{case_id}".encode()).digest()
                seed = int.from_bytes(digest[:4], "little")
                self._inputs[case_id] = families.make_inputs(CASES[case_id], seed)
            return self._inputs[case_id]

    def batch_key(self, case: Case) -> tuple[str, int, str]:
        """The job a case runs in. Side by side, attention's tiers run in jobs apart: each compiles its
        own Triton kernels (fp32, bf16, the leaderboard's shape), and compiles are the job's time."""
        apart = case.tier if case.family == "attention" and self.jobs > 1 else ""
        return case.family, case.world_size, apart

    def plan(self, cases: list[Case]) -> None:
        """The cases this run will judge: their jobs' batches, every job started now when ``jobs`` > 1."""
        for case in cases:
            if self.precheck(case) is None:
                self._batches.setdefault(self.batch_key(case), []).append(case.id)
        if self.jobs <= 1 or not self._batches:
            return
        self._pool = ThreadPoolExecutor(self.jobs, thread_name_prefix="grading-job")
        for key, batch in self._batches.items():
            self._started[key] = self._pool.submit(
                self.runs.outcome, batch[0], batch, CASES[batch[0]].world_size, self.inputs
            )

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)

    def _job_phase(self, batch: list[str], world_size: int, note: str) -> None:
        key = "job " + ",".join(batch)
        if note == JOB_ENDED:
            progress.phase(self.progress, progress.END, key, "")
            return
        words = progress.job_words(batch, world_size)
        progress.phase(
            self.progress, progress.START, key, words if note == JOB_STARTS else f"{words}, {note}"
        )

    def worker_seconds(self, case_id: str) -> dict[str, float | None]:
        """How long ``case_id`` took in its worker and when it began there, for progress lines."""
        outcome = self.runs.done.get(case_id)
        return {"worker_s": outcome.seconds(), "began_s": outcome.began()} if outcome else {}

    def precheck(self, case: Case) -> Verdict | None:
        """A skip decided before any worker runs."""
        for hook in case.hooks:
            if reason := self.probe.reason(hook):
                return Verdict.skipped(NOT_IMPLEMENTED, reason)
        if not case.runs_here(self.on_gpu):
            return Verdict.skipped(NEEDS_GPU, "needs a CUDA GPU (none on this machine)")
        return self.unloadable

    def verdict(self, case: Case) -> Verdict:
        """``case``'s verdict; the planned cases of its ``batch_key`` run in the same job."""
        early = self.precheck(case)
        if early is not None:
            return early
        key = self.batch_key(case)
        if key in self._started:
            self._started[key].result()  # its job's outcomes (a retry of a case alone included)
        batch = self._batches.get(key) or [case.id]
        outcome = self.runs.outcome(case.id, batch, case.world_size, self.inputs)
        try:
            return decide(case, self.inputs(case.id), outcome, self.roots, self.on_gpu)
        finally:
            self._inputs.pop(case.id, None)


def needs(name: str, where: str = "") -> Verdict:
    """A dependency of the student's code that the grading environment lacks: not their failure."""
    pip = Path(sys.executable).parent / "pip"
    at = f"imported at {where}; " if where else ""
    return Verdict.error(
        MISSING_DEPENDENCY, f"cannot grade: needs {name} ({at}install it with `{pip} install {name}`)"
    )


def basics_not_found(roots: StudentRoots) -> Verdict:
    return Verdict.error(
        "cannot-grade",
        f"cannot grade: the repository's cs336_basics was not found ({roots.describe()}); an empty "
        "./cs336-basics is often a git submodule not checked out: point --basics-root at it",
    )


def load_verdict(roots: StudentRoots) -> Verdict | None:
    """Every case's verdict when the adapters file cannot load for an import read from the source
    (``imports``): the student's error (a failure of every case), a declared dependency the grading
    environment lacks, or a ``cs336_basics`` not found; None when nothing is found missing."""
    missing = missing_import(roots)
    if missing is None:
        return None
    if missing.kind == DECLARED:
        return needs(missing.top, missing.where)
    if missing.kind == NO_BASICS:
        return basics_not_found(roots)
    why = f"adapters import failed: no module named {missing.module!r} (imported at {missing.where})"
    return Verdict(FAILED, why, IMPORT_FAILED)


def decide(case: Case, inputs: dict, outcome: Outcome, roots: StudentRoots, on_gpu: bool) -> Verdict:
    if outcome.unfinished:
        return Verdict.skipped(UNFINISHED_HERE, outcome.unfinished)
    if outcome.error:
        return Verdict.error(outcome.error, outcome.problem or outcome.error)
    if outcome.records is None:
        return Verdict.failed(outcome.problem or "no output")
    folders = [p.resolve() for p in roots.folders()]
    for rank, record in enumerate(outcome.records):
        if record.get("status") == "done":
            continue
        if (
            str(record.get("missing_module") or "").split(".")[0] == "cs336_basics"
            and roots.basics_root is None
        ):
            return basics_not_found(roots)
        if dep := record.get("missing_dependency"):
            return needs(text(dep, 60))
        if case.family == "attention":
            return attention.judge_raised(case, record, folders, on_gpu)
        frame = text(record.get("student_frame") or record.get("innermost_frame") or "", 300)
        prefix = f"rank {rank} " if case.world_size > 1 else ""
        return Verdict.failed(
            f"{prefix}raised {text(record.get('message', ''))}" + (f" (at {frame})" if frame else "")
        )
    return families.judge(case, inputs, outcome.records, folders, on_gpu)
