"""Gradescope's autograder, built and run: ``cli.autograder`` writes the zip, and its ``run_autograder``
grades a good, a broken and an empty submission in a temporary folder standing in for ``/autograder``
(only the PyTorch attention's course cases, to stay fast); each ``results.json`` has every field
Gradescope documents and passes the grader's own validator. A submission whose code imports what the
grading environment lacks is "could not grade", never its failure. ``setup.sh`` installs what tox
installs (the same pins file, as requirements and constraints) and the students' dependencies, and
finds or installs a Python the suite runs on (checked here with stand-in interpreters and apt-get; the
environment it builds is ``test_autograder_env.py``'s, behind the ``zip_env`` marker)."""

from __future__ import annotations

import configparser
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from cs336_systems.cli.autograder import build, scripts
from cs336_systems.grading import walls
from cs336_systems.grading.gradescope import problems
from cs336_systems.grading.sandbox import namespaces_work

REPO = Path(__file__).parents[1]
STUDENTS = REPO / "tests" / "data" / "students"
ATTENTION = {"get_flashattention_autograd_function_pytorch", "get_flashattention_autograd_function_triton"}
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
# "status" too, except on a test worth 0 of 0 that was neither passed nor failed (``problems`` checks)
TEST_FIELDS = {"name", "score", "max_score", "output", "tags", "visibility"}


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.mktemp("autograder")
    with zipfile.ZipFile(build(base / "autograder.zip")) as zf:
        names = set(zf.namelist())
        assert {"setup.sh", "run_autograder", "finish.py", "suite/pyproject.toml"} <= names
        assert zf.getinfo("run_autograder").external_attr >> 16 & 0o111, "run_autograder is not executable"
        zf.extractall(base / "source")
    return base / "source"


@pytest.fixture
def stand_in() -> Iterator[Path]:
    """A folder standing in for ``/autograder``, readable by all as Gradescope's is: where setup.sh made
    the grader's user, the workers run as it (pytest's own temporary folders are root's alone)."""
    base = Path(tempfile.mkdtemp(prefix="cs336-autograder-"))
    base.chmod(0o755)
    yield base / "autograder"
    shutil.rmtree(base, ignore_errors=True)


def run_autograder(
    source: Path,
    root: Path,
    submission: Path | None,
    python: str | None = sys.executable,
    args: str = "-- -k pytorch",
    timeout: float = 500,
) -> dict:
    """``run_autograder`` of the unzipped ``source`` in the stand-in ``root``, grading a copy of
    ``submission`` with ``python`` (None: the virtualenv ``setup.sh`` made); its checked results."""
    if not (root / "source").exists():
        shutil.copytree(source, root / "source")
    shutil.rmtree(root / "submission", ignore_errors=True)
    (root / "submission").mkdir(parents=True)
    if submission is not None:
        shutil.copytree(submission, root / "submission", dirs_exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env.pop("TRITON_INTERPRET", None)  # Gradescope sets none: the grader sets it for its CPU workers
    env |= {"AUTOGRADER_ROOT": str(root), "CS336_GRADE_ARGS": args}
    if python is not None:  # an interpreter of this machine's (tox's: root's alone), graded as root
        env |= {"CS336_PYTHON": python, "CS336_WORKER_USER": ""}
    done = subprocess.run(
        ["bash", str(root / "source" / "run_autograder")],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
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
def test_run_autograder(source: Path, stand_in: Path, name: str) -> None:
    doc = run_autograder(source, stand_in, None if name == "empty" else STUDENTS / name)
    statuses = {t["status"] for t in doc["tests"]}
    if name == "src_layout":  # its PyTorch FlashAttention is correct
        assert statuses == {"passed"} and doc["score"] > 0, doc["tests"]
    elif name == "crashes":  # its attention aborts its process
        assert "failed" in statuses and doc["score"] == 0, doc["tests"]
    else:
        assert [t["name"] for t in doc["tests"]] == ["grader failed"] and doc["score"] == 0, doc


@pytest.mark.skipif(
    not namespaces_work(), reason="needs root or unprivileged user namespaces, and util-linux"
)
def test_every_way_out_through_run_autograder_changes_nothing(source: Path, stand_in: Path) -> None:
    """``escapes`` (every way out of its workers, a forged ``results/results.json`` included) graded by
    ``run_autograder``, then an honest submission in the same stand-in: the forged results never stand,
    the grading environment and the autograder's own files are as they were, the honest one passes."""
    shutil.copytree(source, stand_in / "source")
    wire, autograder_files = walls.Tripwire(walls.watched([])), walls.Tripwire([stand_in / "source"])
    doc = run_autograder(source, stand_in, STUDENTS / "escapes")
    assert doc["output"] != "forged by the submission" and doc["score"] == 0, doc
    assert {t["status"] for t in doc["tests"]} == {"failed"}, doc["tests"]
    honest = run_autograder(source, stand_in, STUDENTS / "src_layout")
    assert {t["status"] for t in honest["tests"]} == {"passed"}, honest["tests"]
    assert wire.changed() == [] and autograder_files.changed() == []
    assert not list(stand_in.rglob("poisoned-by-a-neighbour")), "files left for the next submission"


def test_a_missing_dependency_is_could_not_grade(source: Path, stand_in: Path, tmp_path: Path) -> None:
    """The course's cs336_basics imports einx and jaxtyping; here one of its imports is of a module no
    environment has: every case is listed, 0 of 0, "could not grade", none failed, and the summary
    tells the course staff how to add it."""
    repo = shutil.copytree(STUDENTS / "course_deps", tmp_path / "course_deps")
    utils = repo / "cs336-basics" / "cs336_basics" / "nn_utils.py"
    utils.write_text("import cs336_absent_dependency  # noqa: F401\n" + utils.read_text())
    doc = run_autograder(source, stand_in, repo, args="")
    assert {t["name"].split(":")[0] for t in doc["tests"]} == set(ATTENTION), doc["tests"]
    assert all("status" not in t and (t["score"], t["max_score"]) == (0, 0) for t in doc["tests"]), doc
    assert all("needs cs336_absent_dependency" in t["output"] for t in doc["tests"]), doc["tests"]
    assert doc["score"] == 0 and "--student-deps" in doc["output"], doc["output"]


def _requirements(files: list[Path]) -> list[str]:
    lines = (ln.split("#")[0].strip() for f in files for ln in f.read_text().splitlines())
    return sorted(ln.replace(" ", "") for ln in lines if ln)


def _tox_pin_files() -> dict[str, list[Path]]:
    """The requirement (``-r``) and constraint (``-c``) files of tox's ``deps``."""
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(REPO / "tox.ini")
    deps = [d.strip() for d in tox["testenv"]["deps"].splitlines() if d.strip()]
    assert all(d[:2] in ("-r", "-c") for d in deps), f"tox pins outside a file: {deps}"
    return {
        flag: [Path(d[2:].replace("{toxinidir}", str(REPO))) for d in deps if d[:2] == flag]
        for flag in ("-r", "-c")
    }


def test_setup_pins_what_tox_pins_and_installs_the_students_dependencies(tmp_path: Path) -> None:
    """setup.sh installs the pins file tox installs, as requirements and as constraints (so a student's
    dependency cannot move numpy past the Triton interpreter's limit), the zip carries that file as it
    is, and the students' dependencies (the course's and the TA's) are in the list it installs."""
    zipped = build(tmp_path / "autograder.zip", extra_deps=["wandb", "einx>=0.4"])
    with zipfile.ZipFile(zipped) as zf:
        zf.extractall(tmp_path / "source")
    setup = (tmp_path / "source" / "setup.sh").read_text()
    pins = {flag: files for flag, files in _tox_pin_files().items()}
    assert pins["-r"] == pins["-c"] == [REPO / "requirements" / "pins.txt"], pins
    assert "PINS=$SOURCE/suite/requirements/pins.txt" in setup
    assert '-r "$PINS" -c "$PINS"' in setup and '-r "$STUDENT_DEPS"' in setup
    shipped = tmp_path / "source" / "suite" / "requirements" / "pins.txt"
    assert (
        _requirements([shipped])
        == _requirements(pins["-r"])
        == ["numpy<2.3", "torch==2.13.0", "triton==3.6.0"]
    )
    students = _requirements([tmp_path / "source" / "student-deps.txt"])
    assert {"einops>=0.8", "einx>=0.4", "jaxtyping>=0.3", "humanfriendly", "wandb"} <= set(students), students
    assert "download.pytorch.org/whl/cpu" in setup


@pytest.mark.parametrize(
    "spec", ["-r other.txt", "--index-url=https://example.com", "./local", "x; rm -rf /"]
)
def test_a_student_dependency_is_a_requirement_only(tmp_path: Path, spec: str) -> None:
    with pytest.raises(ValueError, match="not a requirement"):
        build(tmp_path / "autograder.zip", extra_deps=[spec])
    assert not (tmp_path / "autograder.zip").exists()


def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


def _setup_shell(tmp_path: Path, call: str, bin_dir: Path) -> subprocess.CompletedProcess:
    """``call`` in a bash that sourced setup.sh (its functions only), with nothing but ``bin_dir`` on
    PATH: the interpreters and apt-get of a machine of our making."""
    (tmp_path / "setup.sh").write_text(scripts()["setup.sh"])
    env = {"PATH": str(bin_dir), "AUTOGRADER_ROOT": str(tmp_path), "HOME": str(tmp_path)}
    command = f"source {tmp_path / 'setup.sh'} && {call}"
    return subprocess.run(
        [shutil.which("bash"), "-c", command], env=env, capture_output=True, text=True, timeout=60
    )


def test_setup_skips_a_python_older_than_the_suites(tmp_path: Path) -> None:
    """Ubuntu 22.04: python3 is 3.10 (a stand-in that fails the version check), python3.12 is not
    there, python3.11 is: setup.sh builds on python3.11 and installs nothing."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "python3", "exit 1")  # what 3.10 answers the check: sys.exit(True)
    (bin_dir / "python3.11").symlink_to(sys.executable)
    _fake(bin_dir, "apt-get", f'echo apt-get "$@" >> {tmp_path / "apt.log"}')
    done = _setup_shell(tmp_path, "find_python", bin_dir)
    assert done.returncode == 0 and done.stdout.strip().endswith("python3.11"), done.stdout + done.stderr
    assert not (tmp_path / "apt.log").exists()


def test_setup_installs_a_python_when_none_fits(tmp_path: Path) -> None:
    """No suitable Python at all: apt-get is asked for 3.12 (24.04's; missing on 22.04), then 3.11
    (22.04's universe), each with its venv package, and setup.sh builds on what it installed."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "python3", "exit 1")
    apt = (
        f'echo "$@" >> {tmp_path / "apt.log"}\n'
        f'case "$*" in *python3.12*) exit 100;; *python3.11*) {shutil.which("ln")} -s '
        f"{sys.executable} {bin_dir / 'python3.11'};; esac"
    )
    _fake(bin_dir, "apt-get", apt)
    done = _setup_shell(tmp_path, "python_for_venv", bin_dir)
    assert done.returncode == 0 and done.stdout.strip().endswith("python3.11"), done.stdout + done.stderr
    calls = (tmp_path / "apt.log").read_text().splitlines()
    assert calls[0].startswith("update") and "python3.12 python3.12-venv" in calls[1], calls
    assert "python3.11 python3.11-venv" in calls[2], calls


@pytest.mark.parametrize("broken", ["interpreter", "suite"])
def test_results_json_is_written_when_nothing_could_be_graded(tmp_path: Path, broken: str) -> None:
    """The grading never ran: the suite is not in the image (``cli.grade`` cannot start), or the grading
    interpreter is gone too (``finish.py`` cannot run). Gradescope still gets a results.json with every
    field, a visible "grader failed", 0 points."""
    root = tmp_path / "autograder"
    (root / "source").mkdir(parents=True)
    for name, text in scripts().items():
        (root / "source" / name).write_text(text)
    python = str(tmp_path / "gone" / "python3") if broken == "interpreter" else sys.executable
    doc = run_autograder(root / "source", root, STUDENTS / "src_layout", python=python, timeout=60)
    assert [t["name"] for t in doc["tests"]] == ["grader failed"] and doc["score"] == 0, doc
    assert doc["tests"][0]["status"] == "failed" and doc["extra_data"]["grade_exit"] != 0, doc
