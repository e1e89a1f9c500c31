"""The walls around the graded code, tried as a class of students would try them (CPU).

A class of three in one command: ``a_escapes`` tries every way out of its workers at import (a
neighbour's code rewritten, a ``.pth`` and a ``sitecustomize`` planted in the grading environment and
torch's folder, files left in ``HOME``, the caches, ``/tmp`` and ``/dev/shm``, a forged ``results.json``, a
neighbour's attention read and handed in as its own); ``b_honest`` is correct and fails at import if it
finds anything a neighbour left where it looks (its ``HOME``, ``/tmp``, ``/dev/shm``, its caches);
``c_zeros`` returns zeros, which only a bent judge would pass. Graded after ``a_escapes``, ``b_honest``
passes and ``c_zeros`` fails, as alone; the grading environment, the suite and the neighbours' trees are
byte-identical before and after; a regrade of ``a_escapes`` fails. Without the walls this test fails
(tried: ``CS336_GRADE_ISOLATION=subreaper``, where the tripwire then stops the class).

Beside it: the probe finds what stays writable, a class does not start where the walls do not hold
unless the TA accepts the risk by name, and the tripwire stops a class whose code wrote a neighbour.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cs336_systems.grading import walls
from cs336_systems.grading.sandbox import Sandbox, namespaces_work
from cs336_systems.grading.settings import ISOLATION_ENV

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(420), pytest.mark.xdist_group("test_walls")]
walled = pytest.mark.skipif(
    not namespaces_work(), reason="needs root or unprivileged user namespaces, and util-linux"
)
MARK = "poisoned-by-a-neighbour"
OBSERVANT = f'''
import os as _os
import pathlib as _pathlib

for _folder in {{_os.environ.get(v) for v in ("HOME", "TMPDIR", "TRITON_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR")}}:
    if _folder and (_pathlib.Path(_folder) / "{MARK}").exists():
        raise RuntimeError(f"found what a neighbour left in {{_folder}}")
for _folder in ("/tmp", "/dev/shm"):
    if (_pathlib.Path(_folder) / "{MARK}").exists():
        raise RuntimeError(f"found what a neighbour left in {{_folder}}")
'''
ZEROS = """

class _Zeros(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        ctx.save_for_backward(q, k, v, torch.zeros(q.shape[:2], device=q.device))
        return torch.zeros_like(q)

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None


def get_flashattention_autograd_function_pytorch() -> type:
    return _Zeros
"""


def _class_folder(root: Path) -> dict[str, Path]:
    repos = {
        "a_escapes": STUDENTS / "escapes",
        "b_honest": STUDENTS / "src_layout",
        "c_zeros": STUDENTS / "src_layout",
    }
    copies = {name: shutil.copytree(path, root / name) for name, path in repos.items()}
    for name in ("b_honest", "c_zeros"):
        adapters = copies[name] / "tests" / "adapters.py"
        body = adapters.read_text().replace("from __future__ import annotations\n", "")
        extra = ZEROS if name == "c_zeros" else ""
        adapters.write_text(f"from __future__ import annotations\n{OBSERVANT}\n{body}{extra}")
    return copies


def _grade(
    targets: list[Path], out: Path, env: dict | None = None, *extra: str
) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "cs336_systems.cli.grade",
        *map(str, targets),
        "--out",
        str(out),
        "--jobs",
        "1",
    ]
    cmd += ["--tiers", "course", "--timeout", "120", *extra, "--", "-k", "course-pytorch"]
    return subprocess.run(cmd, cwd=ROOT, env=env or clean_env(), capture_output=True, text=True, timeout=400)


def _digest(folders: list[Path]) -> dict[str, str]:
    found = {}
    for folder in folders:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                found[str(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _left_behind() -> list[Path]:
    home = Path(os.path.expanduser("~"))
    places = [home, home / ".triton" / "cache", home / ".cache", Path("/tmp"), Path("/dev/shm")]
    places.append(Path(f"/tmp/torchinductor_{os.environ.get('USER', 'root')}"))
    return [p / MARK for p in places if (p / MARK).exists()]


def _statuses(out: Path, name: str) -> set[str]:
    report = json.loads((out / name / "grade.json").read_text())
    return {c["status"] for c in report["cases"] if c["status"] != "skipped"}


@walled
def test_an_honest_repository_after_every_way_out_gets_its_own_verdict(tmp_path: Path) -> None:
    stray = _left_behind()
    assert not stray, f"left from an earlier run, remove them first: {stray}"
    repos = _class_folder(tmp_path / "class")
    env_listing = walls.Tripwire(walls.watched([]))
    neighbours = _digest([repos["b_honest"], repos["c_zeros"]])
    run = _grade(list(repos.values()), tmp_path / "out")
    out = tmp_path / "out"
    assert "could not be trusted" not in run.stdout + run.stderr, run.stdout[-3000:]
    assert _statuses(out, "b_honest") == {"passed"}, (out / "b_honest" / "grade.json").read_text()[-2000:]
    assert _statuses(out, "c_zeros") == {"failed"}, "zeros passed: the judge was bent"
    assert _statuses(out, "a_escapes") == {"failed"}, "it read a neighbour's attention"
    assert env_listing.changed() == [], "the grading environment or the suite changed"
    assert _digest([repos["b_honest"], repos["c_zeros"]]) == neighbours, "a neighbour's tree changed"
    assert not _left_behind(), "files were left for the next repository"
    grade = json.loads((out / "a_escapes" / "grade.json").read_text())
    assert grade["walls"] and not walls.holes(
        grade["walls"], tuple({k.split(":")[0] for k in grade["walls"]})
    )
    assert "walls: the graded code wrote none" in run.stdout, run.stdout[-2000:]
    again = _grade([repos["a_escapes"]], tmp_path / "again")
    assert _statuses(tmp_path / "again", "a_escapes") == {"failed"}, again.stdout[-2000:]


def test_the_probe_finds_what_stays_writable(tmp_path: Path) -> None:
    neighbour = tmp_path / "neighbour"
    (neighbour / "tests").mkdir(parents=True)
    places = [walls.Place("neighbour", neighbour), walls.Place("results", tmp_path)]
    open_door = walls.probe(Sandbox(namespaces=False, scratch=tmp_path / "s1"), places)
    assert walls.holes(open_door) == [f"neighbour: {neighbour}"], open_door
    assert list(neighbour.rglob(f"{walls.MARKER}*")) == [], "the probe's markers stay behind"
    if namespaces_work():
        held = walls.probe(Sandbox(hidden=(neighbour,), scratch=tmp_path / "s2"), places)
        assert set(held.values()) == {walls.HELD}, held


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(worker_user=None, accept_shared_writes=False, **kw)


def test_a_class_does_not_start_where_a_neighbour_stays_writable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    from cs336_systems.cli import grade

    repos = {"a": STUDENTS / "src_layout", "b": STUDENTS / "crashes"}
    monkeypatch.setenv(ISOLATION_ENV, "subreaper")
    assert not grade._walls_hold(_args(), repos, tmp_path)
    said = capsys.readouterr()
    assert "not grading a class here" in said.err and "--accept-shared-writes" in said.err, said.err
    assert "can WRITE" in said.out
    accepted = _args()
    accepted.accept_shared_writes = True
    assert grade._walls_hold(accepted, repos, tmp_path)
    assert grade._walls_hold(_args(), {"a": STUDENTS / "src_layout"}, tmp_path), "one repository: a warning"
    assert "warning" in capsys.readouterr().err


SABOTEUR = """
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
for sibling in ROOT.parent.iterdir():
    target = sibling / "tests" / "adapters.py"
    if sibling != ROOT and target.is_file():  # rewritten in place, its size and modification time kept
        st = target.stat()
        target.write_bytes(target.read_bytes()[:-1] + b" ")
        os.utime(target, ns=(st.st_atime_ns, st.st_mtime_ns))


def get_flashattention_autograd_function_pytorch():
    return object  # implemented (a worker loads this file), and wrong
"""


def test_the_tripwire_stops_a_class_whose_code_wrote_a_neighbour(tmp_path: Path) -> None:
    """Without the walls (accepted by name), the tripwire is what is left: the class stops as soon as the
    repository that wrote is done, before its neighbour is graded on the changed tree."""
    saboteur, honest = tmp_path / "class" / "a_saboteur", tmp_path / "class" / "b_honest"
    (saboteur / "tests").mkdir(parents=True)
    (saboteur / "tests" / "adapters.py").write_text(SABOTEUR)
    shutil.copytree(STUDENTS / "src_layout", honest)
    env = clean_env() | {ISOLATION_ENV: "subreaper"}
    run = _grade([saboteur, honest], tmp_path / "out", env, "--accept-shared-writes")
    said = run.stdout + run.stderr
    assert run.returncode == 1, said[-3000:]
    assert "class stopped" in said and "b_honest/tests/adapters.py" in said, said[-3000:]
    failure = (tmp_path / "out" / "a_saboteur" / "failure.txt").read_text()
    assert failure.startswith("could not be trusted: wrote") and "b_honest" in failure, failure
    assert not (tmp_path / "out" / "b_honest" / "grade.json").exists(), "graded on a changed tree"


def test_the_tripwire_sees_a_rewrite_that_kept_the_size_and_put_the_time_back(tmp_path: Path) -> None:
    """A write that keeps a file's size and restores its modification time (``os.utime``) still changes
    its change time, which no unprivileged process can set back."""
    neighbour = tmp_path / "adapters.py"
    neighbour.write_text("def f():\n    return 1\n")
    wire = walls.Tripwire([tmp_path])
    time.sleep(0.05)  # past the filesystem's timestamp granularity (a jiffy)
    st = neighbour.stat()
    neighbour.write_text("def f():\n    return 2\n")
    os.utime(neighbour, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert neighbour.stat().st_mtime_ns == st.st_mtime_ns and neighbour.stat().st_size == st.st_size
    assert wire.changed() == [str(neighbour)]


def test_the_tripwire_sees_what_runs_and_passes_over_what_comes_and_goes(tmp_path: Path) -> None:
    """Planted code the tripwire must list: a ``.pth`` named like the probe's markers (``site`` runs a
    hidden one), a neighbour's git hook and git config (git runs them when the TA next pulls). What it
    passes over: a probe's marker in flight, and the git objects and index any git command rewrites."""
    site, repo = tmp_path / "site-packages", tmp_path / "neighbour"
    (repo / ".git" / "hooks").mkdir(parents=True)
    site.mkdir()
    (repo / ".git" / "config").write_text("[core]\n")
    wire = walls.Tripwire([site, repo])
    planted = [
        site / f"{walls.MARKER}0123456789abcdef.pth",
        repo / ".git" / "hooks" / "post-merge",
        repo / ".git" / "config",
    ]
    time.sleep(0.05)  # past the filesystem's timestamp granularity (a jiffy)
    for path in planted:
        path.write_text("import os; os.system('echo planted')\n")
    (site / f"{walls.MARKER}{secrets.token_hex(walls.TOKEN_BYTES)}").touch()
    (repo / ".git" / "index").write_bytes(b"DIRC")
    (repo / ".git" / "objects" / "ab").mkdir(parents=True)
    assert wire.changed() == sorted(str(p) for p in planted)


def test_the_tripwire_watches_the_user_site_even_before_it_exists(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An interpreter outside a virtual environment runs ``~/.local/lib/pythonX.Y/site-packages`` (its
    ``.pth`` files, a ``usercustomize``) in every grading process: planting one there shows."""
    user_site = tmp_path / "home" / ".local" / "lib" / "site-packages"
    monkeypatch.setattr(walls.site, "ENABLE_USER_SITE", True)
    monkeypatch.setattr(walls.site, "getusersitepackages", lambda: str(user_site))
    wire = walls.Tripwire(walls.watched([]))
    user_site.mkdir(parents=True)
    (user_site / "usercustomize.py").write_text("import os\n")
    assert wire.changed() == [str(user_site / "usercustomize.py")]


COURSE_TEST = """
from pathlib import Path

from .adapters import get_flashattention_autograd_function_pytorch


def test_loads():
    assert get_flashattention_autograd_function_pytorch() is not None


def test_writes_outside(tmp_path):
    Path("{outside}").write_text("written by the course's tests")
"""


@walled
def test_the_course_tests_run_inside_the_walls(tmp_path: Path) -> None:
    """A repository's own tests (``--course-tests own``) are its code too: they run in the same walls as a
    worker, and one that writes outside them fails there without writing."""
    from cs336_systems.grading.repo import course_tests
    from cs336_systems.grading.roots import discover

    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    outside = ROOT / "tests" / "data" / f".course-tests-{os.getpid()}"
    (repo / "tests" / "__init__.py").write_text("")
    (repo / "tests" / "test_attention.py").write_text(COURSE_TEST.format(outside=outside))
    try:
        found = course_tests.run(discover(repo / "tests" / "adapters.py"), None, timeout=120)
        assert not outside.exists(), "the course's tests wrote outside the walls"
    finally:
        outside.unlink(missing_ok=True)
    group = found["get_flashattention_autograd_function_pytorch"]
    assert group["counts"] == {"passed": 1, "failed": 1}, found
    assert group["failed"] == ["test_attention::test_writes_outside"], found


@walled
def test_the_observer_and_the_observed_meet_in_the_jobs_own_tmp(tmp_path: Path) -> None:
    """Nsight Compute's injection finds its host through ``/tmp`` and ``/dev/shm`` (error: "No kernels were
    profiled" when the walled process has its own and the host the machine's): the observer runs with the
    job's as its own. The observed process sees what the observer left there, cannot write its report,
    and the machine's ``/tmp`` and ``/dev/shm`` stay as they were."""
    from cs336_systems.grading.sandbox import JobFolder

    sandbox, job = Sandbox(scratch=tmp_path / "scratch"), JobFolder.make(tmp_path)
    (tmp_path / "scratch").mkdir()
    report, marker = tmp_path / "observed", f"host-{os.getpid()}"
    report.mkdir()
    host = f'touch /tmp/{marker} /dev/shm/{marker} && echo kernels > {report}/ncu.csv && exec "$@"'
    observed = f"ls /tmp/{marker} /dev/shm/{marker} > {job.out}/seen; echo forged > {report}/ncu.csv"
    inner = sandbox.wrap(["sh", "-c", observed], job, [], job.path)
    cmd = [*sandbox.observer(("sh", "-c", host, "observer"), job, [], job.path, (report,)), *inner]
    try:
        subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert (job.out / "seen").read_text().split() == [f"/dev/shm/{marker}", f"/tmp/{marker}"]
        assert (report / "ncu.csv").read_text() == "kernels\n", "the observed process rewrote the report"
        assert not (Path("/tmp") / marker).exists() and not (Path("/dev/shm") / marker).exists()
    finally:
        job.remove()


@walled
def test_a_repositorys_caches_outlive_its_jobs_and_no_other_repository_sees_them(tmp_path: Path) -> None:
    """``HOME``, ``TMPDIR`` and the compile caches are the repository's (inductor keeps its precompiled
    headers under ``TMPDIR``: a folder per job rebuilt them in every job), seeded with what the grader
    compiled itself; another repository starts from the seed alone."""
    from cs336_systems.grading import caches
    from cs336_systems.grading.sandbox import JobFolder

    places = "$HOME $TMPDIR $TRITON_CACHE_DIR $TORCHINDUCTOR_CACHE_DIR"
    write = f"for d in {places}; do echo mine > $d/left; done"
    read = f"for d in {places}; do cat $d/left 2>/dev/null || echo none; done; ls $TORCHINDUCTOR_CACHE_DIR | wc -l"

    def run(scratch: Path, script: str) -> list[str]:
        if not scratch.exists():
            scratch.mkdir()
            caches.seed_scratch(scratch)
        sandbox, job = Sandbox(scratch=scratch), JobFolder.make(tmp_path)
        sandbox.prepare(job)
        try:
            cmd = sandbox.wrap(["sh", "-c", script], job, [], job.path)
            done = subprocess.run(cmd, env={**os.environ, **sandbox.env()}, capture_output=True, text=True)
            return done.stdout.split()
        finally:
            job.remove()

    run(tmp_path / "a", write)
    assert run(tmp_path / "a", read)[:4] == ["mine"] * 4, "a repository's second job lost its caches"
    seen = run(tmp_path / "b", read)
    assert seen[:4] == ["none"] * 4, "another repository saw them"
    if caches.seed() is not None:
        assert int(seen[4]) > 0, "a repository's inductor cache does not start from the seed"
