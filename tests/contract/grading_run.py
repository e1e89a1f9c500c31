"""Running the contract on an adapters file in a pytest subprocess, as a grader would, and reading
its per-hook report (``--grade-json``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"


@dataclass
class GradingRun:
    returncode: int
    output: str
    hooks: dict

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
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/contract",
        *option,
        "--grade-json",
        str(report),
        "-n",
        "0",
        "-p",
        "no:cacheprovider",
        "-q",
        "--no-header",
        "-W",
        "ignore",
        *args,
    ]
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTEST_XDIST_WORKER", "CS336_ADAPTERS", "CS336_GRADE_PROBE")
    }
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    hooks = json.loads(report.read_text())["hooks"] if report.is_file() else {}
    report.unlink(missing_ok=True)
    return GradingRun(run.returncode, run.stdout + run.stderr, hooks)
