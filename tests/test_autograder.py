"""Gradescope's autograder, built and run: ``cli.autograder`` writes the zip, and its ``run_autograder``
grades a good, a broken and an empty submission in a temporary folder standing in for ``/autograder``
(only the PyTorch attention's course cases, to stay fast); each ``results.json`` has every field
Gradescope documents and passes the grader's own validator."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cs336_systems.cli.autograder import build
from cs336_systems.grading.gradescope import problems

REPO = Path(__file__).parents[1]
STUDENTS = REPO / "tests" / "data" / "students"
TOP = {
    "score",
    "execution_time",
    "output",
    "visibility",
    "stdout_visibility",
    "extra_data",
    "tests",
    "leaderboard",
}
TEST_FIELDS = {"name", "score", "max_score", "status", "output", "tags", "visibility"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("autograder")
    with zipfile.ZipFile(build(base / "autograder.zip")) as zf:
        names = set(zf.namelist())
        assert {"setup.sh", "run_autograder", "finish.py", "suite/pyproject.toml"} <= names
        assert zf.getinfo("run_autograder").external_attr >> 16 & 0o111, "run_autograder is not executable"
        zf.extractall(base / "source")
    return base / "source"


def run_autograder(source: Path, root: Path, submission: Path | None) -> dict:
    shutil.copytree(source, root / "source")
    (root / "submission").mkdir(parents=True)
    if submission is not None:
        shutil.copytree(submission, root / "submission", dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env |= {"AUTOGRADER_ROOT": str(root), "CS336_PYTHON": sys.executable, "CS336_GRADE_ARGS": "-- -k pytorch"}
    done = subprocess.run(
        ["bash", str(root / "source" / "run_autograder")],
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    results = root / "results" / "results.json"
    assert results.is_file(), done.stdout[-2000:] + done.stderr[-2000:]
    doc = json.loads(results.read_text())
    assert set(doc) >= TOP, sorted(TOP - set(doc))
    assert all(set(t) >= TEST_FIELDS for t in doc["tests"]), doc["tests"]
    assert problems(doc) == []
    assert isinstance(doc["execution_time"], int | float) and isinstance(doc["leaderboard"], list)
    return doc


@pytest.mark.parametrize("name", ["src_layout", "crashes", "empty"])
def test_run_autograder(source: Path, tmp_path: Path, name: str) -> None:
    doc = run_autograder(source, tmp_path / "autograder", None if name == "empty" else STUDENTS / name)
    statuses = {t["status"] for t in doc["tests"]}
    if name == "src_layout":  # its PyTorch FlashAttention is correct
        assert statuses == {"passed"} and doc["score"] > 0, doc["tests"]
    elif name == "crashes":  # its attention aborts its process
        assert "failed" in statuses and doc["score"] == 0, doc["tests"]
    else:
        assert [t["name"] for t in doc["tests"]] == ["grader failed"] and doc["score"] == 0, doc
