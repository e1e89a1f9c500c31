"""What ran on the GPU, seen from outside the graded process: Nsight Compute's command line.

The observed run is a second timing worker started under ``ncu``, which records every kernel launched
during the observed calls (one round of the parent's clock, on fresh inputs the parent verifies, each
call and its backward between ``cudaProfilerStart`` and ``Stop``) with its GPU time
(``gpu__time_duration.sum``), and writes them to a file this process names, in a folder the graded code
cannot write (under the grader's sandbox). The graded code can stop the recording itself (the profiler
API is process-wide): the rules compare what was seen with the parent's clock, so hidden work shows. ncu's host process is not the graded process; its
report is not anything the graded Python can rewrite. Caches and clocks are left alone
(``--cache-control none --clock-control none``), so each kernel takes about the time it takes untimed.

Where there is no ncu (or no GPU), the row's attribution is the graded process's own record
(``worker/provenance.py``): reported as such, and ranked below every observed row.
"""

from __future__ import annotations

import csv
import io
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

METRIC = "gpu__time_duration.sum"
NCU_ENV = "CS336_NCU"  # a path to ncu, or "0" to grade without an observer


def ncu_path() -> str | None:
    configured = os.environ.get(NCU_ENV)
    if configured == "0":
        return None
    found = configured or shutil.which("ncu")
    if not found:
        for candidate in sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"), reverse=True):
            return str(candidate)
        candidate = Path("/usr/local/cuda/bin/ncu")
        return str(candidate) if candidate.exists() else None
    return found


def command(ncu: str, log: Path) -> tuple[str, ...]:
    """The prefix that runs a worker under ncu, recording only the kernels between
    ``cudaProfilerStart`` and ``Stop`` (the observed calls: the compile, the warm-up, drawing the inputs
    and fingerprinting run unrecorded)."""
    return (
        ncu,
        "--target-processes",
        "all",
        "--profile-from-start",
        "off",
        "--metrics",
        METRIC,
        "--cache-control",
        "none",
        "--clock-control",
        "none",
        "--csv",
        "--log-file",
        str(log),
    )


@dataclass
class Observed:
    """GPU time per kernel name (ms) inside the observed range."""

    kernels: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    connected: bool = True  # ncu reached the worker (else it saw nothing through no fault of the code)

    def total_ms(self) -> float:
        return sum(self.kernels.values())

    def share(self, names: set[str]) -> float:
        total = self.total_ms()
        return sum(ms for n, ms in self.kernels.items() if n in names) / total if total > 0 else 0.0


def parse(text: str) -> Observed:
    """ncu's ``--csv`` report: one row per (kernel launch, metric); the header row names the columns.
    Durations come in ``nsecond``, ``usecond`` or ``msecond``. A report without ncu's "Connected to
    process" line means the observer never reached the worker."""
    scale = {
        "nsecond": 1e-6,
        "ns": 1e-6,
        "usecond": 1e-3,
        "us": 1e-3,
        "msecond": 1.0,
        "ms": 1.0,
        "second": 1e3,
    }
    lines = [ln for ln in text.splitlines() if ln.startswith('"')]
    seen = Observed(connected="==PROF== Connected to process" in text)
    for row in csv.DictReader(io.StringIO("\n".join(lines))):
        if row.get("Metric Name") != METRIC:
            continue
        try:
            value = float(str(row.get("Metric Value", "")).replace(",", ""))
        except ValueError:
            continue
        unit = scale.get(str(row.get("Metric Unit", "")).strip())
        if unit is None:
            continue
        name = str(row.get("Kernel Name", "?"))
        seen.kernels[name] = seen.kernels.get(name, 0.0) + value * unit
        seen.launches += 1
    return seen
