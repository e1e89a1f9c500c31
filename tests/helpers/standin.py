"""Stand-ins for tests of runs that are interrupted or run out of time: a bench file whose cases take no
torch and no time, or sleep until told not to (a file ``fast`` beside it), each writing its pytest's pid
beside it; and what a test needs to look at processes and run a command in a process group of its own,
as a terminal runs it (a Ctrl-C there is SIGINT to the whole group)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

BENCH = """
import os
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent


@pytest.mark.parametrize("case", {cases!r})
def test_case(case, benchmark):
    (HERE / f"{{case}}.pid").write_text(str(os.getpid()))
    if case.startswith("slow") and not (HERE / "fast").exists():
        time.sleep({sleep_s})
    benchmark.pedantic(lambda: None, rounds=1)
"""


def write_bench(folder: Path, cases: tuple[str, ...], sleep_s: float = 300) -> str:
    """``folder/test_standin.py`` with one case per name (``slow*`` ones sleep ``sleep_s``); the file's
    name, as the sweep takes it from ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "test_standin.py").write_text(BENCH.format(cases=list(cases), sleep_s=sleep_s))
    return "test_standin.py"


def node_id(case: str) -> str:
    return f"test_standin.py::test_case[{case}]"


def env() -> dict[str, str]:
    """This environment for a child command of the suite: its sources first, no pytest worker's marks."""
    found = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    found["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), found.get("PYTHONPATH", "")])
    found["OMP_NUM_THREADS"] = "1"
    return found


def sweep(*args: str) -> list[str]:
    return [sys.executable, "-m", "cs336_systems.cli.sweep", *args]


def start(command: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    """``command`` in a process group of its own, its output (both streams) into ``log``."""
    with log.open("w") as out:
        return subprocess.Popen(
            command, cwd=cwd, env=env(), stdout=out, stderr=subprocess.STDOUT, process_group=0
        )


def interrupt(proc: subprocess.Popen, signum: int) -> None:
    """SIGINT as a terminal's Ctrl-C sends it (to the whole process group); SIGTERM as ``kill`` does
    (to the process alone)."""
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        os.kill(proc.pid, signum)


def wait_until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {timeout_s:.0f} s for {what}")
        time.sleep(0.2)


def alive(pid: int) -> bool:
    """Whether ``pid`` is a living process (a zombie is dead)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def processes_naming(text: str) -> list[str]:
    """The command lines of living processes that hold ``text`` (a test's folder: what it started)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and alive(int(entry.name)):
            try:
                cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmdline:
                found.append(f"{entry.name}: {cmdline[:200]}")
    return found
