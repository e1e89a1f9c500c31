"""One leaderboard row: the 2025 case timed on the parent's clock, observed from outside, judged here.

``row`` runs a timing worker of the repository's code (``worker/timing.leaderboard``) with the parent's
clock talking to it (``repo/leaderboard/clock.py``), then, where this machine has Nsight Compute, an observed run of
one more round under ``ncu`` (``observer.py``); it verifies every timed iteration against the reference
and decides the rank (``repo/leaderboard/standing.py``). ``anchors`` times the suite's own kernel and cuDNN the same
way. Where each number of a row comes from: ``docs/grading.md``, "The leaderboard".
"""

from __future__ import annotations

import dataclasses
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ...exchange import text
from ...roots import SUITE_ROOT, StudentRoots, discover
from ...sandbox import jobs_parent
from ...shared.cases import LEADERBOARD_CASE, RANK_GATES, TRITON_HOOK
from . import clock, observer_turn, standing
from .observer import Observed, command, ncu_path, parse, phases

TIMED_SHARE = 0.6  # of a row's time budget, for the timed run (compile, the course's do_bench, two rounds)
RETRY_MIN_S = 30.0  # the least time left for a second observed run (less: the first one's reading stands)
Observation = tuple[Observed | None, int, str | None]  # what ncu saw, the calls it saw, why it does not count
PROTOCOL = "torch.compile(apply) (eager where compiling fails); parent's clock over verified iterations"
REFERENCES = {
    "suite kernel": SUITE_ROOT / "tests" / "adapters.py",
    "cuDNN (SDPA)": Path(__file__).resolve().parent / "references" / "cudnn_adapters.py",
}


def course_failures(report: dict | None) -> list[str] | None:
    """The Triton hook's failing cases in the tiers that gate a rank, the course's (None when those were
    not graded)."""
    cases = [
        c
        for c in (report or {}).get("cases", [])
        if c.get("tier") in RANK_GATES and TRITON_HOOK in (c.get("hooks") or [])
    ]
    graded = [c for c in cases if c.get("status") != "skipped"]
    if not graded:
        return None
    return [c["id"] for c in graded if c.get("status") != "passed"]


def row(
    roots: StudentRoots,
    report: dict | None,
    plan: clock.ClockPlan | None = None,
    device: str = "cuda",
    observe: bool = True,
    keep_times: bool = False,
    shape: tuple[int, int, int] | None = None,
    compile: bool = True,
    dtype: str = LEADERBOARD_CASE.dtype,
    lock: Path | None = None,
    wait_record: Path | None = None,
    budget_s: float | None = None,
) -> dict[str, Any]:
    """The row of one repository; ``report`` is its grade (the course tier's verdicts). ``keep_times``
    keeps the course figure's every do_bench time (the benches' rows record them). ``lock``: a file the
    observed runs of one machine take in turn (concurrent ncu sessions starve each other: ``observer_turn``);
    ``wait_record``: where the
    wait for that turn is recorded, for the class run to add to the repository's time limit.
    ``budget_s``: what is left of the repository's time limit for the row (None: the clock's own
    limits): the timed run takes at most ``TIMED_SHARE`` of it and the observed run the rest, so that a
    run the repository's limit would have stopped ends the row with a reason instead."""
    import torch

    deadline = time.monotonic() + budget_s if budget_s is not None else None
    plan = plan or clock.ClockPlan()
    observed_wait_s = plan.wait_s  # the observed run's own, cut below to what is left then
    plan = within(plan, budget_s * TIMED_SHARE if budget_s is not None else None)
    shape = shape or LEADERBOARD_CASE.shape  # another shape: a stand-in workload (the CPU's tests)
    timed, ms, problem = _timed(roots, plan, shape, device, compile, dtype)
    result = timed.get("result") or {}
    evidence = standing.Evidence(
        course_failures=course_failures(report),
        clock_problem=problem,
        parent_ms=ms,
        course_ms=result.get("mean_ms"),
        floor_ms=_floor_ms(device),
        self_record=result.get("provenance"),
        roots=[p.resolve() for p in roots.folders()],
    )
    ncu = ncu_path() if observe and device == "cuda" else None
    note = None if ncu else "no observer on this machine (ncu)"
    if ncu:
        # What was left when the turn was asked for: the wait for it is not the repository's time (the
        # class run extends its limit by the wait).
        left = deadline - time.monotonic() if deadline is not None else None
        with observer_turn.turn(lock, wait_record):
            seen, evidence.observed_iterations, why = observe(
                lambda seconds: _observed(roots, ncu, shape, device, observed_wait_s, seconds), left
            )
        if why:
            evidence.clock_problem = "; ".join(filter(None, [evidence.clock_problem, why]))
        if seen is not None and not seen.connected:
            note, seen = (
                "the observer never reached the worker (no ncu report): attribution self-reported",
                None,
            )
        evidence.observed = seen
        if seen is not None:
            evidence.phases = phases(seen, evidence.observed_iterations)
        from ...judge.kernel_names import repository_kernels

        evidence.repo_kernels = repository_kernels(roots.folders())
    decided = standing.standing(evidence)
    return {
        "gpu": torch.cuda.get_device_name(0) if device == "cuda" else device,
        "compiled": bool(result.get("compiled")),
        "compile_error": text(result["compile_error"], 600) if result.get("compile_error") else None,
        "error": text(result["error"]) if result.get("error") else None,
        "protocol": PROTOCOL,
        "iterations": timed.get("iterations"),
        "worker_s": {k: result[k] for k in ("compile_s", "recorded_s", "do_bench_s") if k in result},
        "observer": note,
        **decided,
    } | ({"course_times_ms": result.get("times_ms")} if keep_times else {})


def _timed(
    roots: StudentRoots,
    plan: clock.ClockPlan,
    shape: tuple[int, int, int],
    device: str,
    compile: bool,
    dtype: str,
) -> tuple[dict, float | None, str | None]:
    """The timing worker's record (the course figure, its own provenance), the parent's time per
    iteration, and why that time does not count (None when every round verified)."""
    args = {
        "compile": compile,
        "rep": LEADERBOARD_CASE.rep_ms if device == "cuda" else 0,
        "warmup": LEADERBOARD_CASE.warmup_ms,
    }
    got, talk, why = _clock_run(roots, plan, args, shape, device, dtype)
    record = got.records.get(("timing", 0)) or {}
    out = {"result": record.get("result") if record.get("status") == "done" else None}
    if talk is not None and len(talk.rounds) == plan.rounds:
        out["iterations"] = talk.rounds[-1].iterations
    return out, None if why or talk is None else clock.per_iteration_ms(talk), why


def within(plan: clock.ClockPlan, seconds: float | None) -> clock.ClockPlan:
    """``plan`` with its waits cut so that its whole job (``2 x wait_s``) fits ``seconds``."""
    if seconds is None:
        return plan
    return dataclasses.replace(plan, wait_s=max(1.0, min(plan.wait_s, seconds / 2)))


def observe(once: Callable[[float | None], Observation], seconds: float | None) -> Observation:
    """``once`` (an observed run, given the seconds it may take), run a second time when ncu reached the
    worker and saw no kernel at all: another profiler session on the host (a second class, a user's own
    ncu or nsys) starves it that way, a fault of the machine, not of the code. Code that stops the
    recording itself leaves the same empty report twice and gets no rank either way."""
    start = time.monotonic()
    got = once(seconds)
    seen, _, why = got
    if why or seen is None or not seen.connected or seen.total_ms() > 0:
        return got
    left = None if seconds is None else seconds - (time.monotonic() - start)
    return got if left is not None and left < RETRY_MIN_S else once(left)


def _observed(
    roots: StudentRoots,
    ncu: str,
    shape: tuple[int, int, int],
    device: str,
    wait_s: float,
    seconds: float | None = None,
) -> Observation:
    """One round under ncu, verified like a timed one: the kernels it ran and their GPU time; its
    waits ``wait_s``, cut to fit ``seconds``."""
    plan = within(clock.ClockPlan(rounds=1, wait_s=wait_s), seconds)
    # the observer's report lives beside the job folders, which the grader's sandbox keeps read-only to
    # the graded code
    folder = Path(tempfile.mkdtemp(prefix="observed-", dir=jobs_parent()))
    log = folder / "ncu.csv"
    try:
        _, talk, why = _clock_run(
            roots, plan, {"observe": True}, shape, device, LEADERBOARD_CASE.dtype, command(ncu, log), folder
        )
        if why or talk is None:
            return None, 0, f"the observed run: {why}"
        seen = parse(log.read_text(errors="replace")) if log.is_file() else Observed()
        return seen, talk.rounds[0].iterations, None
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _clock_run(
    roots: StudentRoots,
    plan: clock.ClockPlan,
    args: dict[str, Any],
    shape: tuple[int, int, int],
    device: str,
    dtype: str,
    prefix: tuple[str, ...] = (),
    prefix_writes: Path | None = None,
) -> tuple[Any, clock.ClockRun | None, str | None]:
    """A timing worker with the parent's clock talking to it (under ``prefix``, an observer), and every
    round it handed back verified: what the job left, the clock's rounds, and why they do not count."""
    import torch

    from ...judge.runner import Job, run

    base = {"shape": shape, "device": device, "dtype": dtype, "rounds": plan.rounds, "wait_s": plan.wait_s}
    job = Job(
        roots,
        "timing.leaderboard",
        args=base | args,
        timeout=plan.wait_s * 2,
        conversation=clock.conversation(plan),
        records=plan.records(),
        files=plan.files(),
        prefix=prefix,
        prefix_writes=(prefix_writes,) if prefix_writes else (),
    )
    got = run(job)
    talk = got.conversation
    if not isinstance(talk, clock.ClockRun):
        return got, None, f"the parent's clock failed: {text(talk)}"
    if talk.problem or len(talk.rounds) < plan.rounds:
        why = talk.problem or "the clock's rounds did not finish"
        return got, talk, f"{why} ({_job_trouble(got)})"
    for i, round_ in enumerate(talk.rounds):
        rec = got.records.get((clock.result_name(i), 0)) or {}
        if why := clock.verify(rec.get("fingerprints"), round_, shape, torch.device(device), dtype):
            return got, talk, why
    return got, talk, None


def _job_trouble(got: Any) -> str:
    problems = [got.job_problem, *got.problems.values()]
    return text(next((p for p in problems if p), "no output"), 400)


def _floor_ms(device: str) -> float | None:
    if device != "cuda":
        return None
    import torch

    from cs336_systems.profiling.flops import attention_flops, dense_bf16_peak_tflops

    peak = dense_bf16_peak_tflops(torch.cuda.get_device_name(0))
    b, s, d = LEADERBOARD_CASE.shape
    flops = attention_flops(1, s, d, heads=b, causal=LEADERBOARD_CASE.causal, pass_="fwd_bwd")
    return flops / (peak * 1e9) if peak else None


def anchors(plan: clock.ClockPlan | None = None) -> list[dict[str, Any]]:
    """The suite's kernel and cuDNN, timed the same way as the students' rows (references, never
    ranked)."""
    rows = []
    for name, adapters in REFERENCES.items():
        got = row(discover(adapters), None, plan, observe=False)
        rows.append({"name": name, **{k: got.get(k) for k in ("parent_ms", "course_ms", "agreement", "gpu")}})
    return rows


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json

    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.grading.repo.leaderboard.row",
        description="Time the leaderboard's references (the suite's kernel, cuDNN) as the students' rows are "
        "timed, on this machine's first GPU; write them as JSON.",
    )
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args(argv)
    rows = anchors()
    args.json.write_text(json.dumps({"rows": rows, "protocol": PROTOCOL}, indent=1))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
