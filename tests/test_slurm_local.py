"""``scripts/slurm_local.sh stop`` and ``status`` against stand-in daemons (``sleep`` processes behind the
pid files the script reads, in folders of the test): ``stop`` ends what ``start`` began, munged and
MariaDB included, and ``status`` says which daemon runs and which does not."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from .helpers.standin import REPO, alive

pytestmark = pytest.mark.timeout(120)

SCRIPT = REPO / "scripts" / "slurm_local.sh"
DAEMONS = ("munged", "mysqld", "slurmdbd", "slurmctld", "slurmd")


def _cluster(tmp_path: Path) -> tuple[dict[str, str], dict[str, subprocess.Popen]]:
    """Stand-in daemons (``sleep``) behind the pid files the script reads, in folders of this test."""
    state, run = tmp_path / "state", tmp_path / "run"
    files = {"munged": run / "munge" / "munged.pid", "mysqld": run / "mysqld" / "mysqld.pid"}
    procs = {}
    for name in DAEMONS:
        path = files.get(name, state / f"{name}.pid")
        path.parent.mkdir(parents=True, exist_ok=True)
        procs[name] = subprocess.Popen(["sleep", "300"])
        path.write_text(f"{procs[name].pid}\n")
    (state / "began").write_text("munged\nmysqld\n")  # what `start` records having begun
    return {"SLURM_LOCAL_DIR": str(state), "SLURM_LOCAL_RUN": str(run), "PATH": "/usr/bin:/bin"}, procs


def test_the_local_clusters_stop_ends_what_start_began(tmp_path: Path) -> None:
    env, procs = _cluster(tmp_path)
    try:
        stopped = subprocess.run(
            ["bash", SCRIPT, "stop"], env=env, capture_output=True, text=True, timeout=60
        )
        for proc in procs.values():
            proc.poll()
        assert stopped.returncode == 0, stopped.stderr
        assert [n for n, p in procs.items() if alive(p.pid)] == [], stopped.stdout + stopped.stderr
        assert all(f"{name}: stopped" in stopped.stdout for name in DAEMONS), stopped.stdout
        status = subprocess.run(
            ["bash", SCRIPT, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 1
        assert all(f"{name}: not running" in status.stdout for name in DAEMONS), status.stdout
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()


def test_the_local_clusters_status_says_what_runs_and_what_does_not(tmp_path: Path) -> None:
    env, procs = _cluster(tmp_path)
    try:
        procs["slurmd"].kill()
        procs["slurmd"].wait()
        status = subprocess.run(
            ["bash", SCRIPT, "status"], env=env, capture_output=True, text=True, timeout=60
        )
        assert status.returncode == 1, status.stdout
        assert f"slurmctld: running (pid {procs['slurmctld'].pid})" in status.stdout, status.stdout
        assert "slurmd: not running" in status.stdout and "not usable" in status.stdout, status.stdout
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
