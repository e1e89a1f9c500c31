"""Grading an adapters file from a test: ``grade`` runs the contract through its pytest front end in a
subprocess (``pytest tests/contract --adapters PATH --grade-json``) and reads its report; ``verdicts`` grades chosen cases in this process through
``grading.judge.session.Grader`` (workers still run the graded code in processes of their own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from cs336_systems.grading.judge.session import Grader
from cs336_systems.grading.probe import probe
from cs336_systems.grading.roots import discover
from cs336_systems.grading.shared.cases import CASES
from cs336_systems.grading.verdict import Verdict

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"
STUDENTS = DATA / "students"


def clean_env() -> dict[str, str]:
    """This process's environment without what a pytest run sets for its own workers."""
    return {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTEST_XDIST", "CS336_ADAPTERS", "CS336_GRADE"))
    }


@dataclass
class GradingRun:
    returncode: int
    output: str
    report: dict

    @property
    def hooks(self) -> dict:
        return self.report.get("hooks", {})

    def failures(self, hook: str) -> str:
        return "\n".join(f["message"] for f in self.hooks.get(hook, {}).get("failures", []))


def grade(adapters: Path | str, *args: str, equals_form: bool = False, timeout: float = 400) -> GradingRun:
    """``pytest tests/contract --adapters PATH ARGS`` (``--adapters=PATH`` when ``equals_form``) from
    the suite's root, in a fresh process."""
    report = (
        Path(os.environ.get("TMPDIR", "/tmp"))
        / f"grade-{os.getpid()}-{abs(hash((str(adapters), args)))}.json"
    )
    option = [f"--adapters={adapters}"] if equals_form else ["--adapters", str(adapters)]
    cmd = [sys.executable, "-m", "pytest", "tests/contract", *option, "--grade-json", str(report)]
    cmd += ["-n", "0", "-p", "no:cacheprovider", "-q", "--no-header", "-W", "ignore", *args]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=timeout)
    found = json.loads(report.read_text()) if report.is_file() else {}
    report.unlink(missing_ok=True)
    return GradingRun(run.returncode, run.stdout + run.stderr, found)


def verdicts(adapters: Path, case_ids: list[str], seed: int = 1) -> dict[str, Verdict]:
    """Each case's verdict, the cases of one family and world size graded in one job."""
    roots = discover(adapters)
    grader = Grader(roots, probe(roots.adapters), seed, timeout=240.0)
    grader.plan([CASES[c] for c in case_ids])
    return {cid: grader.verdict(CASES[cid]) for cid in case_ids}
