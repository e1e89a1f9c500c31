"""Fixtures of tests/ beyond the root conftest's: ``slurm``, the one-node cluster of
``scripts/slurm_local.sh``. Its tests run against a running cluster, or start one when
``CS336_SLURM=1`` (root; it installs slurm-wlm, munge and MariaDB with apt-get where they are missing):
starting a database and three daemons is no part of ``tox -e tests``, whose budget is ten minutes on two
cores. Elsewhere they skip, saying how to run them."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from cs336_systems.harness.settings import settings

SCRIPT = Path(__file__).parents[1] / "scripts" / "slurm_local.sh"


def _cannot_start() -> str | None:
    if os.name != "posix" or os.geteuid() != 0:
        return "not root: scripts/slurm_local.sh starts munged, MariaDB and the Slurm daemons as root"
    if not shutil.which("sbatch") and not shutil.which("apt-get"):
        return "no Slurm here and no apt-get to install slurm-wlm"
    return None


@pytest.fixture(scope="module")
def slurm() -> None:
    if subprocess.run([SCRIPT, "status"], capture_output=True, timeout=60).returncode == 0:
        return
    if not settings().slurm:
        pytest.skip("no Slurm cluster running: `scripts/slurm_local.sh start`, or CS336_SLURM=1 to start one")
    if why := _cannot_start():
        pytest.skip(f"Slurm is not running and cannot be started: {why}")
    started = subprocess.run([SCRIPT, "start"], capture_output=True, text=True, timeout=600)
    assert started.returncode == 0, f"scripts/slurm_local.sh start failed: {started.stderr[-1500:]}"
