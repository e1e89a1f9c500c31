"""The autograder's environment as Gradescope builds it: the zip's ``setup.sh`` run into a stand-in
``/autograder`` (``AUTOGRADER_ROOT``), then ``run_autograder`` with the virtualenv it made. The pins
hold (torch's CPU build where there is no GPU, Triton 3.6, numpy < 2.3: Triton's CPU interpreter fails
under numpy 2.4, pip's newest), the students' dependencies import, a second run
changes nothing, and the suite's honest submissions with a Triton forward, one of each edition (the
2026 one's code needs einx and jaxtyping), get their full score; so does every real repository given
with ``--zip-submission=PATH``.

Behind the ``zip_env`` marker (tox's ``tests`` run leaves it out; ``tox -e tests -- -m zip_env -n 0 tests/test_autograder_env.py`` runs it): it
downloads torch (about 200 MB) unless pip's configuration has it, and takes minutes. It skips, saying
so, where no package index answers."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cs336_systems.cli.autograder import GRADER_USER, build
from tests.test_autograder import REPO, STUDENTS, run_autograder

pytestmark = pytest.mark.zip_env
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
IMPORTS = ["einops", "einx", "jaxtyping", "humanfriendly", "regex", "tqdm", "tiktoken", "psutil"]
VERSIONS = """import importlib, json, torch, triton, numpy
for name in {imports}:
    importlib.import_module(name)
print(json.dumps({{"torch": torch.__version__, "cuda": torch.version.cuda, "triton": triton.__version__,
                  "numpy": numpy.__version__}}))"""


def _why_no_index(tmp: Path) -> str | None:
    """Why pip cannot fetch a package here (None: it can), asked the way setup.sh asks."""
    try:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--dest", str(tmp), "einx"],
            capture_output=True,
            text=True,
            timeout=180,
        )
    except subprocess.TimeoutExpired:
        return "pip download einx did not answer in 180 s"
    return None if got.returncode == 0 else f"pip download einx failed: {got.stderr.strip()[-300:]}"


def _reachable(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=15):
            return True
    except OSError:
        return False


def _system_env(root: Path) -> dict[str, str]:
    """This machine's environment as Gradescope's would be: on PATH, neither tox's virtualenv nor a
    folder under this user's home (pyenv's shims: a Python there, under a private home, is one the
    grader's user cannot run), and no pytest or Triton variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST", "TRITON_"))}
    env.pop("VIRTUAL_ENV", None)
    private = (Path(sys.executable).parent, Path.home())
    path = env.get("PATH", "").split(os.pathsep)
    env["PATH"] = os.pathsep.join(p for p in path if not any(Path(p).is_relative_to(q) for q in private))
    return env | {"AUTOGRADER_ROOT": str(root)}


def _setup(root: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    done = subprocess.run(
        ["bash", str(root / "source" / "setup.sh")], env=env, capture_output=True, text=True, timeout=1800
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done, time.monotonic() - started


def _size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink()) / 2**20


def _user_exists() -> bool:
    return subprocess.run(["id", GRADER_USER], capture_output=True).returncode == 0


@pytest.fixture(scope="module")
def stand_in(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """A stand-in ``/autograder`` built by the zip's own setup.sh: its root, environment and measures.
    Readable by all, as Gradescope's is (the workers run as the grader's user); the user, when setup.sh
    made it here, is removed afterwards."""
    if why := _why_no_index(tmp_path_factory.mktemp("probe")):
        pytest.skip(f"no package index reachable, so setup.sh cannot install anything here: {why}")
    base, had_user = Path(tempfile.mkdtemp(prefix="cs336-zip-env-")), _user_exists()
    base.chmod(0o755)
    try:
        yield _built(base / "autograder")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        if not had_user and _user_exists() and os.geteuid() == 0:
            subprocess.run(["userdel", "--remove", GRADER_USER], capture_output=True)


def _built(root: Path) -> dict:
    with zipfile.ZipFile(build(root.parent / "autograder.zip")) as zf:
        zf.extractall(root / "source")
    env = _system_env(root)
    # Where torch's CPU index does not answer, pip's own configuration must hold the CPU build.
    cpu_index = _reachable(CPU_INDEX + "/")
    if not cpu_index:
        env["CS336_TORCH_INDEX"] = "none"
    done, seconds = _setup(root, env)
    venv = root / "source" / "venv"
    print(
        f"\nsetup.sh: {seconds:.0f} s, virtualenv {_size_mb(venv):.0f} MB, CPU index reachable: {cpu_index}"
    )
    return {
        "root": root,
        "env": env,
        "seconds": seconds,
        "log": done.stdout + done.stderr,
        "cpu_index": cpu_index,
    }


def _pins() -> dict[str, Requirement]:
    lines = (ln.split("#")[0].strip() for ln in (REPO / "requirements" / "pins.txt").read_text().splitlines())
    return {(r := Requirement(ln)).name: r for ln in lines if ln}


def test_setup_builds_the_pinned_environment(stand_in: dict) -> None:
    python = stand_in["root"] / "source" / "venv" / "bin" / "python"
    got = subprocess.run(
        [str(python), "-c", VERSIONS.format(imports=IMPORTS)], capture_output=True, text=True, timeout=300
    )
    assert got.returncode == 0, got.stderr[-2000:]
    versions = json.loads(got.stdout.splitlines()[-1])
    for name, pin in _pins().items():
        assert pin.specifier.contains(versions[name], prereleases=True), (name, versions[name], str(pin))
    if stand_in["cpu_index"]:  # else pip's configuration chose (this machine's holds a CPU build)
        assert versions["cuda"] is None, f"torch's CUDA build, not its CPU wheels: {versions}"
    print(f"\ngrading environment: {versions}")


def test_setup_runs_again_unchanged(stand_in: dict) -> None:
    made = stand_in["root"] / "source" / "venv" / "pyvenv.cfg"  # written anew when the venv is made
    before = made.stat().st_ino, made.stat().st_mtime_ns
    _, seconds = _setup(stand_in["root"], stand_in["env"])
    assert (made.stat().st_ino, made.stat().st_mtime_ns) == before, "the virtualenv was made again"
    print(f"\nsetup.sh again: {seconds:.0f} s")


def _source(stand_in: dict) -> Path:
    return stand_in["root"] / "source"  # unzipped and set up already: run_autograder copies nothing


def _full_score(doc: dict) -> None:
    graded = [t for t in doc["tests"] if "status" in t]
    assert graded and all(t["status"] == "passed" for t in graded), [
        (t["name"], t["output"][:300]) for t in graded if t["status"] != "passed"
    ]
    total = math.fsum(t["max_score"] for t in doc["tests"])  # hundredths as floats: 29.999999999999993
    why = f"{doc['score']} of {total}: {doc['output']}"
    assert doc["score"] > 0 and math.isclose(doc["score"], total, abs_tol=1e-6), why


# The suite's honest fixtures, one of each edition, each with a Triton forward run by the CPU interpreter:
# (repository, cli.grade arguments, score). triton_tile64 (1.0.5) has only the Triton hook; course_deps
# (26.1.4) needs einx and jaxtyping, both attention hooks.
HONEST = [("triton_tile64", "-- -k triton", 10), ("course_deps", "", 15)]


@pytest.mark.parametrize(("name", "args", "score"), HONEST, ids=[h[0] for h in HONEST])
def test_an_honest_submission_gets_its_full_score(stand_in: dict, name: str, args: str, score: float) -> None:
    doc = run_autograder(_source(stand_in), stand_in["root"], STUDENTS / name, python=None, args=args)
    _full_score(doc)
    hooks = {t["name"].split(":")[0] for t in doc["tests"] if "status" in t}
    assert "get_flashattention_autograd_function_triton" in hooks and doc["score"] == score, doc["tests"]


def test_real_submissions_get_their_full_score(stand_in: dict, request: pytest.FixtureRequest) -> None:
    """Each repository given with ``--zip-submission`` (one of each edition, say), graded as
    Gradescope would: its full score."""
    repos = [Path(p) for p in request.config.getoption("--zip-submission") or []]
    if not repos:
        pytest.skip("no real repository given: --zip-submission=PATH (repeatable; with '=')")
    for repo in repos:
        started = time.monotonic()
        doc = run_autograder(_source(stand_in), stand_in["root"], repo, python=None, args="", timeout=3000)
        total = math.fsum(t["max_score"] for t in doc["tests"])
        print(f"\n{repo.name}: {doc['score']} / {total:.2f} in {time.monotonic() - started:.0f} s")
        _full_score(doc)
