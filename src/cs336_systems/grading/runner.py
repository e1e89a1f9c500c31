"""Starting grading workers and collecting what they report.

One worker process per rank runs ``worker/__main__.py`` with the student's roots on its path. A rank
that dies ends its peers at once (they would wait on it), and a run past its time limit is killed:
either way every case of the run gets that error. ``CaseRuns`` runs the selected cases of a check
together (ranks cost seconds to start), and when such a run crashes, runs each case again alone, so
that one case's crash fails that case only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cs336_systems.distributed.launch import find_free_port

from .roots import SUITE_PACKAGE, StudentRoots, suite_paths
from .worker.settings import OUT_ENV

WORKER = Path(__file__).resolve().parent / "worker" / "__main__.py"
WHOLE_RUN_ERRORS = ("load", "refused")  # the adapters did not load / the guard refused: every case's verdict


def _env(rank: int, world_size: int, port: int, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_XDIST_WORKER", "PYTEST_CURRENT_TEST")}
    # PYTHONPATH may hold what the grader installed beside (``--target`` folders): keep it, absolute
    # (a worker runs in the student's repo), without the suite's own roots.
    banned = {Path(p).resolve() for p in suite_paths()}
    kept = [Path(p).resolve() for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(str(p) for p in kept if p not in banned)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        **{OUT_ENV: str(out)},
        PYTHONUNBUFFERED="1",
    )
    if not torch.cuda.is_available():
        env.setdefault("TRITON_INTERPRET", "1")
        env.setdefault("OMP_NUM_THREADS", "1")
    return env


def _tail(file: Path) -> str:
    lines = [line for line in file.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1].strip()[:400] if lines else "(no output)"


def run_job(
    roots: StudentRoots,
    task: str,
    args: dict,
    world_size: int = 1,
    timeout: float = 300.0,
    backend: str = "gloo",
) -> list[dict]:
    """Each rank's payload: ``{"result": ...}`` or ``{"error": one line, "kind": load|refused|crash|timeout}``."""
    job = {
        "paths": roots.paths(),
        "suite_paths": suite_paths(),
        "dists": [{"name": k, "version": v} for k, v in roots.dists.items()],
        "adapters": str(roots.adapters),
        "forbidden": None if roots.self_grade else str(SUITE_PACKAGE),
        "task": task,
        "args": args,
        "backend": backend,
    }
    with tempfile.TemporaryDirectory(prefix="cs336-grade-") as tmp:
        folder = Path(tmp)
        (folder / "job.json").write_text(json.dumps(job))
        port = find_free_port()
        procs = []
        for rank in range(world_size):
            log = (folder / f"rank{rank}.log").open("w")
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(folder / "job.json")],
                    cwd=roots.repo_root,
                    env=_env(rank, world_size, port, folder / f"rank{rank}.json"),
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        failure = _watch(procs, timeout)
        return [_payload(folder, rank, p.returncode, failure) for rank, p in enumerate(procs)]


def _watch(procs: list[subprocess.Popen], timeout: float) -> str | None:
    """Wait for every rank; on the first one that fails, or past ``timeout``, kill the rest."""
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        bad = [p for p in procs if p.poll() not in (None, 0)]
        if bad or time.monotonic() > deadline:
            for p in procs:
                if p.poll() is None:
                    p.kill()
            for p in procs:
                p.wait()
            return None if bad else f"timed out after {timeout:.0f} s"
        time.sleep(0.05)
    return None


def _payload(folder: Path, rank: int, code: int, failure: str | None) -> dict:
    out = folder / f"rank{rank}.json"
    if out.is_file():
        return json.loads(out.read_text())
    if failure:
        return {"error": f"rank {rank} {failure}", "kind": "timeout"}
    how = "was killed after a peer failed" if code in (-9, None) else f"exited with code {code}"
    return {"error": f"rank {rank} {how}: {_tail(folder / f'rank{rank}.log')}", "kind": "crash"}


def merge(per_rank: list[dict], case_id: str) -> dict:
    """One verdict of a case from every rank's: failed if any rank failed (its messages prefixed with
    the rank), skipped if any skipped, else passed."""
    results = [p["result"][case_id] for p in per_rank]
    failed = [(r, res) for r, res in enumerate(results) if res["status"] == "failed"]
    if failed:
        prefix = len(results) > 1
        text = "\n".join((f"rank {r}: " if prefix else "") + res["message"] for r, res in failed)
        return {"status": "failed", "message": text}
    return next((res for res in results if res["status"] == "skipped"), results[0])


class CaseRuns:
    """Per-case verdicts of a check module's cases, run together per world size, and each alone
    again when the shared run crashed. Errors of the whole run (the adapters did not load, the guard
    refused) are every case's verdict."""

    def __init__(self, roots: StudentRoots, timeout: float):
        self.roots, self.timeout = roots, timeout
        self.done: dict[tuple[str, str], dict] = {}

    def verdict(
        self, module: str, case_id: str, selected: list[str], world_size: int = 1, backend: str = "gloo"
    ) -> dict:
        if (module, case_id) not in self.done:
            batch = [c for c in selected if (module, c) not in self.done] or [case_id]
            self._run(module, batch, world_size, backend, retry_alone=len(batch) > 1)
        return self.done[(module, case_id)]

    def _run(self, module: str, batch: list[str], world_size: int, backend: str, retry_alone: bool) -> None:
        per_rank = run_job(self.roots, module, {"cases": batch}, world_size, self.timeout, backend)
        errors = [p for p in per_rank if "error" in p]
        if not errors:
            self.done.update({(module, c): merge(per_rank, c) for c in batch})
            return
        first = min(errors, key=lambda p: p["kind"] != "crash")  # a crash names its cause; kills follow it
        if first["kind"] in ("crash", "timeout") and retry_alone:
            for case_id in batch:
                self._run(module, [case_id], world_size, backend, retry_alone=False)
            return
        verdict = {
            "status": "error" if first["kind"] in WHOLE_RUN_ERRORS else "failed",
            "message": first["error"],
            "kind": first["kind"],
        }
        self.done.update({(module, c): verdict for c in batch})
