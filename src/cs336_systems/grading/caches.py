"""The compile caches a repository's code starts with: a copy of what the grader compiled itself, never
anything another repository's code wrote.

Each repository's code compiles into caches of its own (``sandbox``: a shared cache is a way to plant
code in a neighbour's kernels). A fresh inductor cache pays inductor's CPU instruction-set probes and its
precompiled C++ header again (about 8 and 10 s of a first CPU ``torch.compile`` on the 2-core machine);
they are facts of the machine, not of any repository. The grader builds them once per machine and torch
version, in a process that runs no graded code, into a folder of its own (``seed``: ``inductor/``, and
``tmp/``, where inductor keeps its headers whatever its cache says), and each repository's scratch starts
with a copy (``seed_scratch``). The class's tripwire lists the seed too.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# A first CPU compile: inductor's instruction-set probes and the C++ it compiles for any CPU graph
PROBES = "import torch; torch.compile(lambda x: (x * 2).sin().sum())(torch.randn(64))"


def seed_folder() -> Path:
    # torch's version from its metadata: importing torch here cost each repository's job 1.5 s of CPU
    version = importlib.metadata.version("torch")
    return Path(os.path.expanduser("~")) / ".cache" / "cs336-grader" / f"compile-seed-{version}"


@functools.cache
def seed() -> Path | None:
    """The seed of inductor caches, built here if it is not yet (None where it cannot be)."""
    folder = seed_folder()
    if folder.is_dir():
        return folder
    building = None
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        building = Path(tempfile.mkdtemp(prefix="building-", dir=folder.parent))
        (building / "tmp").mkdir()
        env = {
            **os.environ,
            "TORCHINDUCTOR_CACHE_DIR": str(building / "inductor"),
            "TMPDIR": str(building / "tmp"),
        }
        subprocess.run([sys.executable, "-c", PROBES], env=env, capture_output=True, timeout=300, check=True)
        os.rename(building, folder)  # whole or not at all; another process may have won the race
    except (OSError, subprocess.SubprocessError):
        if building is not None:
            shutil.rmtree(building, ignore_errors=True)
    return folder if folder.is_dir() else None


def seed_scratch(scratch: Path) -> None:
    """A repository's scratch starts with a copy of the seed (its own to change)."""
    if (found := seed()) is not None:
        shutil.copytree(found, scratch, dirs_exist_ok=True)
