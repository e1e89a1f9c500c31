"""scripts/compare_revisions.py on the CPU: the parent commit exported and compared with the tree under
Triton's interpreter, through the public attention API, so that the refactor check cannot rot again."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "compare_revisions.py"


def _parent(rev: str = "HEAD~1") -> str:
    """``rev`` as a commit; skips where there is no git history."""
    probe = subprocess.run(
        ["git", "rev-parse", "--verify", f"{rev}^{{commit}}"], cwd=ROOT, capture_output=True
    )
    if probe.returncode != 0:
        pytest.skip(f"no revision {rev} in this checkout (a shallow clone or an export)")
    return rev


@pytest.mark.timeout(180)
def test_the_parent_commit_against_the_tree_on_the_cpu(tmp_path: Path) -> None:
    # Break tried: the script importing an internal module of the old tree that no longer exists
    # (as it once imported kernels.flash_attention) -> the run exits non-zero here.
    rev = _parent()
    subprocess.run([sys.executable, SCRIPT, "export", rev, tmp_path / "old"], cwd=ROOT, check=True)
    out = tmp_path / "ab.json"
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{tmp_path / 'old'}",
    }
    args = ["run", "--shapes", "tiny", "--device", "cpu", "--rounds", "1", "--out", out]
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 2
    for row in rows:
        assert row["rel_diff"] < 1e-4, row  # the same kernels' numbers, both trees
        assert row["eager"]["old_ms"] > 0 and row["eager"]["new_ms"] > 0
