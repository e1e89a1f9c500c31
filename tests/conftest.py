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


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``--dist loadgroup`` (tox's) runs the tests of one ``xdist_group`` in one worker: each worker suffixes
    their node ids with ``@group``, and the scheduler keeps an id's group together. pytest-xdist 3.8
    writes the suffix to ``Item._nodeid``, which pytest 9.2 no longer reads (the id is ``Item._id``, a
    parsed ``NodeId``), so the groups were spread over the workers as under ``--dist load``, and each
    worker ran a grading family's job or a module fixture's run again. The suffix goes where pytest reads
    it, unless it is there already (a pytest-xdist that writes it itself)."""
    if not getattr(config.option, "loadgroup", False) or not items or not hasattr(items[0], "_id"):
        return  # not a loadgroup worker, or a pytest whose ids pytest-xdist sets itself
    for item in items:
        marks = item.iter_markers("xdist_group")
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default")) for m in marks})
        suffix = "@" + "_".join(names)
        if names and not item.nodeid.endswith(suffix):
            item._id = type(item._id).parse(item.nodeid + suffix)
