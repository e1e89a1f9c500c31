"""How a grading run schedules its workers, without starting any: with ``jobs`` > 1 every job starts
before the first verdict and they run side by side; the inputs do not depend on the schedule; the
case workers run one thread each; a class run times the anchors once per model of GPU."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from cs336_systems.grading.class_run.classroom import ClassRun, Running
from cs336_systems.grading.judge import runner
from cs336_systems.grading.judge.runner import Outcome
from cs336_systems.grading.judge.session import Grader
from cs336_systems.grading.probe import probe
from cs336_systems.grading.repo.repo_job import RepoOptions
from cs336_systems.grading.roots import discover
from cs336_systems.grading.shared.cases import BEYOND, CASES, LEADERBOARD

from .grading_run import ROOT

PYTORCH = "course-pytorch-match-b4-q128-k128-d64-full-fp32-cpu"
DDP = "individual-course-ws2-course-toy-all-sgd"
DRAWN = [PYTORCH, DDP, "sharded-course-ws2-course-toy-adamw-course-one-group"]
DRAWN += ["fsdp-course-train-ws2-fp32-sgd-0.01", "fsdp-course-grad-sync-ws2-fp16-sgd-0.01"]


def _grader(jobs: int, seed: int = 7) -> Grader:
    roots = discover(ROOT / "tests" / "adapters.py")
    return Grader(roots, probe(roots.adapters), seed, timeout=60.0, on_gpu=False, jobs=jobs)


def _fake_jobs(grader: Grader, barrier: threading.Barrier | None) -> list[list[str]]:
    """Replace the grader's jobs by ones that wait on ``barrier`` (all parties must be running at
    once) and leave a problem for each case; returns the batches as they start."""
    started: list[list[str]] = []

    def outcome(case_id: str, batch: list[str], world_size: int, make_inputs) -> Outcome:
        if case_id not in grader.runs.done:
            started.append(list(batch))
            if barrier is not None:
                barrier.wait()
            for c in batch:
                grader.runs.done[c] = Outcome(problem=f"fake job of {len(batch)} cases")
        return grader.runs.done[case_id]

    grader.runs.outcome = outcome  # type: ignore[method-assign]
    return started


def test_side_by_side_every_job_starts_before_the_first_verdict() -> None:
    grader = _grader(jobs=2)
    barrier = threading.Barrier(2, timeout=30)  # broken (and the verdict raises) if the jobs ran one by one
    started = _fake_jobs(grader, barrier)
    grader.plan([CASES[PYTORCH], CASES[DDP]])
    try:
        verdict = grader.verdict(CASES[PYTORCH])
    finally:
        grader.close()
    assert sorted(map(tuple, started)) == sorted([(DDP,), (PYTORCH,)])
    assert verdict.status == "failed" and "fake job of 1 cases" in verdict.message, verdict


def test_one_job_at_a_time_starts_each_when_its_first_case_is_judged() -> None:
    grader = _grader(jobs=1)
    started = _fake_jobs(grader, None)
    grader.plan([CASES[PYTORCH], CASES[DDP]])
    assert started == []
    grader.verdict(CASES[DDP])
    assert started == [[DDP]]


def test_attention_tiers_run_in_jobs_apart_only_side_by_side() -> None:
    course, leaderboard = (
        next(c for c in CASES.values() if c.family == "attention" and c.tier == tier)
        for tier in ("course", "leaderboard")
    )
    ddp_beyond = next(
        c for c in CASES.values() if c.family == "ddp" and c.tier == BEYOND and c.world_size == 2
    )
    serial, side_by_side = _grader(jobs=1), _grader(jobs=4)
    assert serial.batch_key(course) == serial.batch_key(leaderboard)
    assert side_by_side.batch_key(course) != side_by_side.batch_key(leaderboard)
    assert side_by_side.batch_key(CASES[DDP]) == side_by_side.batch_key(ddp_beyond)


def _equal(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return isinstance(b, list | tuple) and len(a) == len(b) and all(map(_equal, a, b))
    return a == b


def test_inputs_drawn_by_jobs_side_by_side_are_the_seeds_inputs() -> None:
    """Some input makers seed torch's global generator: drawn from threads at once without the
    grader's lock, one's seed lands in another's draw."""
    serial = {c: _grader(jobs=1).inputs(c) for c in DRAWN}
    for _ in range(3):
        grader = _grader(jobs=4)
        with ThreadPoolExecutor(len(DRAWN) * 2) as pool:
            drawn = list(pool.map(grader.inputs, DRAWN * 2))
        for case_id, got in zip(DRAWN * 2, drawn, strict=True):
            assert _equal(got, serial[case_id]), case_id


def test_case_workers_run_one_thread_each_and_timing_workers_keep_the_machines(monkeypatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert runner._env(0, 2, 12345, "cases")["OMP_NUM_THREADS"] == "1"
    assert runner._env(0, 1, 12345, "timing.leaderboard")["OMP_NUM_THREADS"] == "8"


def test_a_class_run_times_the_anchors_once_per_model_of_gpu(tmp_path: Path, monkeypatch) -> None:
    spawned: list[tuple[str, int | None]] = []

    def start(name: str, gpu: int | None) -> Running:
        spawned.append((name, gpu))
        proc = subprocess.Popen([sys.executable, "-c", "pass"])
        return Running(name, proc, 0.0, gpu, tmp_path / name)

    monkeypatch.setattr(ClassRun, "_spawn", lambda self, name, target, gpu, threads: start(name, gpu))
    monkeypatch.setattr(ClassRun, "_anchor", lambda self, gpu: start(f"anchors (gpu {gpu})", gpu))
    monkeypatch.setattr(ClassRun, "_finished", lambda self, job, outcomes: job.proc.poll() is not None)
    repos = {f"r{i}": tmp_path / f"r{i}" for i in range(5)}
    models = ["H100", "H100", "H200", "H100"]
    run = ClassRun(repos, tmp_path / "out", RepoOptions(bench=True), gpus=4, gpu_models=models, force=True)
    run.log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed with the test's folder
    run.run()
    anchors = [gpu for name, gpu in spawned if name.startswith("anchors")]
    assert sorted(models[g] for g in anchors) == ["H100", "H200"], spawned
    assert [n for n, _ in spawned if n.startswith("r")] == list(repos)
    assert spawned.index(next(s for s in spawned if s[0].startswith("anchors"))) >= len(models)


def test_an_anchors_jobs_progress_says_what_it_does(tmp_path: Path) -> None:
    """It grades no case: "loading its code and starting its first workers" every 15 s read as stuck."""
    run = ClassRun({}, tmp_path / "out", RepoOptions(bench=True), gpus=1)
    run.log = open(tmp_path / "log", "w")  # noqa: SIM115 - closed with the test's folder
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert not run._finished(Running("anchors (gpu 0)", proc, time.monotonic(), 0, tmp_path), {})
    finally:
        proc.kill()
        proc.wait()
    run.log.close()
    line = (tmp_path / "log").read_text()
    assert "timing the suite's kernel and cuDNN" in line and "loading its code" not in line, line


def test_the_plan_skips_what_cannot_run_here() -> None:
    leaderboard = next(c for c in CASES.values() if c.tier == LEADERBOARD)
    grader = _grader(jobs=2)
    started = _fake_jobs(grader, None)
    grader.plan([leaderboard, CASES[PYTORCH]])
    grader.close()
    assert started == [[PYTORCH]], "a case that needs a GPU this machine lacks starts no job"
