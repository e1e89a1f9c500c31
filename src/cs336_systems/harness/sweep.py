"""A bench sweep as jobs: one pytest run per bench case, each writing its own pytest-benchmark JSON,
merged into one JSON that the report reads like a single run's.

One job per case, not per group: a case's warm-up is its own (``run_benchmark`` warms every case up
before timing it), so no two cases share one, and a job per case is what lets a rerun submit only the
cases that are missing or failed.

The sweep's folder holds ``cases/<slug>/`` per case (``bench.json``: the case's pytest-benchmark JSON;
``status.json``: ``done``, ``skipped``, or ``failed``, ``cancelled`` or ``timed out`` with its error, and
the job's id; written as each job ends), ``jobs/`` (submitit's folder: scripts, pickles, logs) and
``sweep.json`` (the merge). Each merged row keeps the machine it ran on in ``extra_info["job"]`` (host,
CPU, job id, the GPUs it was shown or ``null``); its GPU model and load are the ``device_name`` and
``load_avg_1m`` it recorded itself. A job that did not finish is a row too, ``skipped`` with its error.

No torch here: the sweep's own process only collects, submits and merges.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import submitit

from ..jobs.executor import LocalGpus, gpu_claim
from ..jobs.interrupt import JobTimeout, work_ends_with_job
from ..jobs.run import Outcome

FAILED_GROUP = "sweep: jobs that failed"
TAIL = 1500  # characters of a failed run's output kept as its error
UNFINISHED = ("failed", "cancelled", "timed out")  # a job's end that leaves nothing to keep: runs again


class SweepError(RuntimeError):
    """The sweep cannot go on (one line: collection failed, nothing selected...)."""


def collect(python: str, selection: list[str], cwd: Path) -> list[str]:
    """The node ids ``pytest --collect-only -q`` selects from ``selection`` (files, --only, -k...)."""
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *selection]
    run = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600)
    ids = [line.strip() for line in run.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if run.returncode not in (0, 5) or (run.returncode == 0 and not ids):
        tail = (run.stdout + run.stderr).strip().splitlines()[-3:]
        raise SweepError(f"collecting the cases failed (pytest exit {run.returncode}): {' | '.join(tail)}")
    if not ids:
        raise SweepError(f"no bench case selected by {' '.join(selection)}")
    return ids


def slug(node_id: str) -> str:
    """A folder name for a case: readable, and unique through a hash of the whole id."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", node_id.split("::", 1)[-1])[:80]
    return f"{name}-{hashlib.sha1(node_id.encode()).hexdigest()[:8]}"


@dataclass
class CaseFiles:
    folder: Path

    @property
    def bench(self) -> Path:
        return self.folder / "bench.json"

    @property
    def status(self) -> Path:
        return self.folder / "status.json"

    def read_status(self) -> dict[str, Any]:
        try:
            return json.loads(self.status.read_text())
        except (OSError, ValueError):
            return {}

    def write_status(self, **status: Any) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.status.write_text(json.dumps(status, indent=1))


def case_files(out: Path, node_id: str) -> CaseFiles:
    return CaseFiles(out / "cases" / slug(node_id))


def finished(out: Path, node_id: str) -> bool:
    """Whether a previous run completed the case (a rerun leaves it out)."""
    files = case_files(out, node_id)
    state = files.read_status().get("state")
    return state == "skipped" or (state == "done" and files.bench.is_file())


def unfinished(out: Path, node_id: str) -> bool:
    """Whether the case's last job ended with nothing to keep (failed, cancelled or timed out)."""
    return case_files(out, node_id).read_status().get("state") in UNFINISHED


class BenchCase(submitit.helpers.Checkpointable):
    """One job: ``pytest NODE_ID --benchmark-json=...``. Checkpointable: where Slurm preempts the job,
    submitit requeues this same call (the case starts over; a half-timed case has nothing to keep).

    ``local``: on one machine, the GPUs the case claims and sees (:class:`~.executor.LocalGpus`), so that
    cases side by side never time on one GPU; ``None``: the GPUs the scheduler gave."""

    def __init__(
        self,
        node_id: str,
        bench_json: Path,
        python: str,
        cwd: Path,
        extra: list[str],
        timeout_s: float,
        local: LocalGpus | None = None,
    ):
        self.node_id, self.bench_json, self.python = node_id, bench_json, python
        self.cwd, self.extra, self.timeout_s = cwd, extra, timeout_s
        self.local = local

    def __call__(self) -> dict[str, Any]:
        self.bench_json.unlink(missing_ok=True)
        self.bench_json.parent.mkdir(parents=True, exist_ok=True)
        cmd = [self.python, "-m", "pytest", self.node_id, "-q", "-p", "no:cacheprovider"]
        cmd += [f"--benchmark-json={self.bench_json}", *self.extra]
        with work_ends_with_job(), gpu_claim(self.local) as devices:
            env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": devices} if devices else {}))
            rc, output = self._pytest(cmd, env)
        # Passed echoes to the job's log, so `submitit`'s stdout file shows the run.
        sys.stdout.write(output[-TAIL:])
        # The GPUs it was shown, or None: submitit's LocalExecutor sets "" and Slurm nothing without GPUs.
        return {
            "rc": rc,
            "tail": output[-TAIL:],
            "host": _host(),
            "gpus": env.get("CUDA_VISIBLE_DEVICES") or None,
        }

    def _pytest(self, cmd: list[str], env: dict[str, str]) -> tuple[int, str]:
        """pytest's exit status and output; past ``timeout_s`` (the suite's limit, which ends before the
        scheduler's), it is stopped with what it started (a process group of its own) and the job ends
        with that reason."""
        proc = subprocess.Popen(
            cmd,
            cwd=self.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            process_group=0,
        )
        try:
            output, _ = proc.communicate(timeout=self.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise JobTimeout(
                f"pytest ran past the suite's limit of {self.timeout_s:.0f} s and was stopped"
            ) from None
        return proc.returncode, output


def _host() -> str:
    import platform

    return platform.node()


def job_outcome(bench_json: Path, outcome: Outcome) -> dict[str, Any]:
    """The case's status from its job's outcome: done (a row written), skipped (pytest skipped it: no
    row, as in a plain run), or failed, cancelled or timed out (with the error)."""
    if outcome.state != "done":
        return {"state": outcome.state, "error": outcome.error}
    result = outcome.result
    rows = _rows(bench_json)
    if result["rc"] == 0 and rows:
        return {"state": "done", "gpus": result.get("gpus")}
    if result["rc"] == 0 and re.search(r"\bskipped\b", result["tail"]):
        return {"state": "skipped"}
    lines = [line for line in result["tail"].splitlines() if line.strip()]
    return {"state": "failed", "error": f"pytest exit {result['rc']}: " + " | ".join(lines[-4:])[-600:]}


def _rows(path: Path) -> list[dict[str, Any]]:
    try:
        return json.loads(path.read_text()).get("benchmarks") or []
    except (OSError, ValueError):
        return []


def merge(out: Path, node_ids: list[str]) -> dict[str, Any]:
    """One pytest-benchmark JSON of every case, in collection order: each case's rows with its job's
    machine in ``extra_info["job"]``, a failed case as a ``skipped`` row carrying its error."""
    merged: dict[str, Any] = {}
    benchmarks: list[dict[str, Any]] = []
    for node_id in node_ids:
        files = case_files(out, node_id)
        status = files.read_status()
        if status.get("state") == "done" and files.bench.is_file():
            data = json.loads(files.bench.read_text())
            if not merged:
                merged = {k: v for k, v in data.items() if k != "benchmarks"}
            machine = data.get("machine_info") or {}
            job = {
                "host": machine.get("node"),
                "cpu": (machine.get("cpu") or {}).get("brand_raw"),
                "job_id": status.get("job_id"),
                "gpus": status.get("gpus"),  # the GPUs the job was shown (CUDA_VISIBLE_DEVICES)
            }
            for row in data.get("benchmarks") or []:
                row.setdefault("extra_info", {})["job"] = job
                benchmarks.append(row)
        elif status.get("state") in UNFINISHED:
            benchmarks.append(_failed_row(node_id, status))
    merged.setdefault("machine_info", {})
    merged["benchmarks"] = benchmarks
    return merged


def _failed_row(node_id: str, status: dict[str, Any]) -> dict[str, Any]:
    error, state = str(status.get("error") or "no result"), status.get("state", "failed")
    return {
        "group": FAILED_GROUP,
        "name": node_id.split("::", 1)[-1],
        "fullname": node_id,
        "params": {},
        "stats": {},
        "extra_info": {"skipped": f"job {status.get('job_id', '?')} {state}: {error}", "job_state": state},
    }
