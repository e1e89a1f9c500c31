"""Graded code that leaves a process behind to rewrite the results (``adapters_left_behind.py``: zeros
for attention, and at import a double-forked, ``setsid`` process that finds the output folders in its
ancestors' command lines and rewrites ``grade.json``, ``results.json`` and ``class.md`` to pass). The
submission fails with 0 points, the files stay as the grader wrote them, and no such process is alive
once the command returns: with namespaces (the machine's default here) and with subreapers alone."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cs336_systems.grading.sandbox import namespaces_work
from cs336_systems.grading.settings import ISOLATION_ENV

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("suite_self_check")]
ADAPTERS = STUDENTS / "adversary" / "tests" / "adapters_left_behind.py"
HOOK = "get_flashattention_autograd_function_pytorch"
JUDGE_ARGS = ["-k", "course-pytorch-match-b4-q128-k128-d64-full-fp32"]  # one case: the property is the files


def alive(marker: str) -> list[int]:
    """Processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
        except OSError:
            continue
    return found


def _env(marker: str, isolation: str | None = None) -> dict[str, str]:
    env = clean_env() | {"LEFT_BEHIND_MARKER": marker}
    return env | ({ISOLATION_ENV: isolation} if isolation else {})


def _settled(files: list[Path]) -> dict[Path, str]:
    """The files' text once a left-behind process would have had time to rewrite them."""
    first = {f: f.read_text() for f in files}
    time.sleep(2.0)  # the process rewrites every 0.1 s
    assert {f: f.read_text() for f in files} == first, "a result file changed after the command returned"
    return first


def _check_results(results: dict) -> None:
    graded = [t for t in results["tests"] if t["tags"][-1] == HOOK]
    assert graded and all(t["status"] == "failed" and t["score"] == 0 for t in graded), graded
    assert results["score"] == 0, results["score"]


def test_repository_job_with_subreapers_alone(tmp_path: Path) -> None:
    """``repo_job`` as a class run starts it, without namespaces: the subreapers kill the process."""
    marker = f"left-behind-{uuid.uuid4().hex}"
    out, options = tmp_path / "out", tmp_path / "options.json"
    options.write_text(json.dumps({"tiers": "course", "judge_args": JUDGE_ARGS}))
    cmd = [sys.executable, "-m", "cs336_systems.grading.repo.repo_job", str(ADAPTERS), "--out", str(out)]
    run = subprocess.run(
        [*cmd, "--options", str(options)],
        cwd=ROOT,
        env=_env(marker, "subreaper"),
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert run.returncode == 1, run.stdout[-2000:] + run.stderr[-2000:]
    texts = _settled([out / "grade.json", out / "results.json"])
    report = json.loads(texts[out / "grade.json"])
    assert report["isolation"]["isolation"] == "subreaper", report.get("isolation")
    assert report["isolation"]["network"] == "shared", report["isolation"]  # no namespace of any kind
    assert report["hooks"][HOOK]["verdict"] == "FAIL", report["hooks"][HOOK]
    _check_results(json.loads(texts[out / "results.json"]))
    assert not alive(marker), "a process the graded code left is still running"


@pytest.mark.skipif(
    not namespaces_work(), reason="needs root or unprivileged user namespaces, and util-linux"
)
def test_class_run_in_namespaces(tmp_path: Path) -> None:
    """The class command (``cli.grade FILE --out DIR``) on a machine with namespaces."""
    marker = f"left-behind-{uuid.uuid4().hex}"
    out = tmp_path / "class"
    cmd = [sys.executable, "-m", "cs336_systems.cli.grade", str(ADAPTERS), "--out", str(out)]
    cmd += ["--tiers", "course", "--", *JUDGE_ARGS]
    run = subprocess.run(cmd, cwd=ROOT, env=_env(marker), capture_output=True, text=True, timeout=280)
    assert run.returncode == 1, (
        run.stdout[-2000:] + run.stderr[-2000:]
    )  # one repository: its course case fails
    repo = out / "adversary-left_behind"  # an adapters file other than adapters.py: its stem names it
    texts = _settled([out / "class.md", repo / "grade.json", repo / "results.json"])
    assert "| adversary-left_behind | 0 / 5 | FAIL |" in texts[out / "class.md"], texts[out / "class.md"]
    isolation = json.loads(texts[repo / "grade.json"])["isolation"]
    assert isolation["isolation"] == "namespaces" and isolation["network"] == "own", isolation
    _check_results(json.loads(texts[repo / "results.json"]))
    assert not alive(marker), "a process the graded code left is still running"


def test_markers_are_found(tmp_path: Path) -> None:
    """The check above can fail: a process holding the marker is seen."""
    marker = f"left-behind-{uuid.uuid4().hex}"
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", marker])
    try:
        deadline = time.monotonic() + 10  # between fork and exec the child's command line is ours
        while not alive(marker) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert alive(marker) == [proc.pid]
    finally:
        proc.kill()
        proc.wait()
    assert not alive(marker) and os.getpid() not in alive(marker)
