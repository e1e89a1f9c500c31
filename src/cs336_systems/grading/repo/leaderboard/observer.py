"""What ran on the GPU, seen from outside the graded process: Nsight Compute's command line.

The observed run is a second timing worker started under ``ncu``, which records every kernel launched
during the observed calls (one round of the parent's clock, on fresh inputs the parent verifies, each
call and then its backward between ``cudaProfilerStart`` and ``Stop``, each range opened by a marker
kernel, so that ``phases`` tells the forward's kernels from the backward's) with its GPU time
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
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from ...settings import ncu_from_env

METRIC = "gpu__time_duration.sum"
# The kernel ``torch.cuda._sleep(0)`` launches: the marker ``shared/clock.py`` puts first in each observed
# range (a forward's, then its backward's).
PHASE_MARKER = "spin_kernel"


def ncu_path() -> str | None:
    configured = ncu_from_env()
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
    """GPU time per kernel name (ms) inside the observed ranges, and every launch in the order ncu saw
    them (the phase markers among them)."""

    kernels: dict[str, float] = field(default_factory=dict)
    launches: int = 0
    connected: bool = True  # ncu reached the worker (else it saw nothing through no fault of the code)
    sequence: list[tuple[str, float]] = field(default_factory=list)

    @staticmethod
    def of_phases(forward: dict[str, float], backward: dict[str, float], iterations: int = 1) -> Observed:
        """What ncu reports of ``iterations`` calls spending ``forward`` and ``backward`` (ms per kernel
        per call), each phase behind its marker (a stand-in for tests)."""
        seen = Observed()
        for _ in range(iterations):
            for phase in (forward, backward):
                seen.sequence.append((PHASE_MARKER, 0.001))
                seen.sequence += list(phase.items())
        for name, ms in seen.sequence:
            seen.kernels[name] = seen.kernels.get(name, 0.0) + ms
        seen.launches = len(seen.sequence)
        return seen

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
    rows = list(csv.DictReader(io.StringIO("\n".join(lines))))
    rows.sort(key=lambda r: int(r["ID"]) if str(r.get("ID", "")).isdigit() else 0)  # launch order
    for row in rows:
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
        seen.sequence.append((name, value * unit))
        seen.launches += 1
    return seen


@dataclass
class Phases:
    """GPU time per kernel name (ms, all iterations) of the forward calls and of their backwards."""

    forward: dict[str, float]
    backward: dict[str, float]


def phases(seen: Observed, iterations: int) -> Phases | str:
    """The observed launches split at the phase markers (``shared/clock.py`` launches one as each
    forward's and each backward's range starts): the phases, or why they cannot be told apart."""
    marks = [i for i, (name, _) in enumerate(seen.sequence) if PHASE_MARKER in name]
    if len(marks) != 2 * iterations:
        return f"{len(marks)} phase markers for {iterations} observed calls (2 each)"
    split = Phases({}, {})
    for n, (start, end) in enumerate(zip(marks, [*marks[1:], len(seen.sequence)], strict=True)):
        into = split.forward if n % 2 == 0 else split.backward
        for name, ms in seen.sequence[start + 1 : end]:
            into[name] = into.get(name, 0.0) + ms
    for name, ms in seen.sequence[: marks[0] if marks else 0]:  # before the first range's marker
        split.forward[name] = split.forward.get(name, 0.0) + ms
    return split
