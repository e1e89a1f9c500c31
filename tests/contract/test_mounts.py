"""What a walled worker can write, seen from inside one (``Sandbox.wrap``, ``mounts.py``): every mount
read-only but its job's ``out/``, its repository's scratch, its private ``/tmp`` and ``/dev/shm`` (and
``/proc``, which CUDA writes, without its machine-wide knobs); the job's own folder (``job.json``,
``inputs/``) and the folder of every job, the student's code, the suite and the interpreter read-only
even where the private ``/tmp`` made them bound back. Each mount's flags are read from the worker's
``/proc/self/mountinfo`` and each place is tried with a write; both with ``mount_setattr`` and with the
remount of every mount that kernels before 5.12 get (forced here)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.grading import sandbox
from cs336_systems.grading.sandbox import JobFolder, Sandbox, namespaces_work

from .grading_run import STUDENTS


def _namespaces_here() -> bool:
    """Whether this machine lets a process make PID and mount namespaces (root, or unprivileged user
    namespaces, and util-linux): asked of ``unshare`` itself, not of the walls' own probe, so that walls
    broken badly enough to fail that probe fail these tests instead of skipping them."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    cmd = ["unshare", *user, "--pid", "--fork", "--mount-proc", "--mount", "true"]
    return subprocess.run(cmd, capture_output=True, timeout=30).returncode == 0


pytestmark = pytest.mark.skipif(
    not _namespaces_here(), reason="needs root or unprivileged user namespaces, and util-linux"
)
# The /proc paths Docker makes read-only: what a uid-0 worker without capabilities could still change for
# the whole machine (sysctls, sysrq, IRQs).
PROC_KNOBS = ("/proc/sys", "/proc/sysrq-trigger", "/proc/bus", "/proc/fs", "/proc/irq")
# Run in the worker (standard library only): each mount's flags, then a write tried in each place.
LOOK = r"""
import json, os, sys
out, marker, places = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
mounts = {}
with open("/proc/self/mountinfo") as f:
    for line in f:
        fields = line.split()
        mounts[fields[4].encode().decode("unicode_escape")] = fields[5].split(",")[0]
read_only = {}
for path in places:
    read_only[path] = bool(os.statvfs(path).f_flag & os.ST_RDONLY)
    try:
        os.close(os.open(os.path.join(path, marker), os.O_CREAT | os.O_WRONLY, 0o644))
    except OSError:
        pass
with open(os.path.join(out, "seen.json"), "w") as f:
    json.dump({"mounts": mounts, "read_only": read_only}, f)
"""
# ``mounts.py`` as a kernel before 5.12 runs it: no ``mount_setattr``, every mount remounted one by one.
OLD_KERNEL = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("cs336_mounts", {mounts!r})
mounts = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mounts)
mounts._setattr = lambda *args, **kw: False
sys.exit(mounts.main(sys.argv))
"""


def _look_inside(tmp_path: Path, old_kernel: bool) -> tuple[dict, dict[str, bool]]:
    """What a worker of a repository (a copy of a fixture) sees, and where its writes landed: each place
    by its name, looked at from outside on the real filesystem."""
    repo = shutil.copytree(STUDENTS / "src_layout", tmp_path / "repo")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    walls, job = Sandbox(scratch=scratch), JobFolder.make(sandbox.jobs_parent())
    walls.prepare(job)
    (job.path / "inputs").mkdir()
    places = {
        "job": job.path,
        "inputs": job.path / "inputs",
        "every job": job.path.parent,
        "repository": repo,
        "suite": Path(sandbox.__file__).resolve().parent,
        "interpreter": Path(sys.prefix).resolve(),
        "out": job.out,
        "scratch": scratch,
        "tmp": Path("/tmp"),
        "shm": Path("/dev/shm"),
    }
    marker = f".cs336-mounts-test-{os.getpid()}-{int(old_kernel)}"
    knobs = [p for p in PROC_KNOBS if os.path.exists(p)]
    look = [sys.executable, "-I", "-S", "-c", LOOK, str(job.out), marker]
    cmd = walls.wrap([*look, json.dumps([*map(str, places.values()), *knobs])], job, [repo], repo)
    if old_kernel:
        wrapper = tmp_path / "old_kernel.py"
        wrapper.write_text(OLD_KERNEL.format(mounts=str(sandbox.MOUNTS)))
        assert str(sandbox.MOUNTS) in cmd[-1]
        cmd[-1] = cmd[-1].replace(str(sandbox.MOUNTS), str(wrapper))
    landed = {**places, "private tmp": job.tmp, "private shm": job.shm}
    try:
        env = {**os.environ, **walls.env()}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr[-2000:]
        seen = json.loads((job.out / "seen.json").read_text())
        wrote = {name: (path / marker).exists() for name, path in landed.items()}
    finally:
        for path in landed.values():
            (path / marker).unlink(missing_ok=True)
        job.remove()
    seen["places"] = {name: str(path) for name, path in places.items()}
    return seen, wrote


@pytest.mark.parametrize("old_kernel", [False, True], ids=["mount_setattr", "remount-each"])
def test_a_worker_writes_only_its_own_places(tmp_path: Path, old_kernel: bool) -> None:
    seen, wrote = _look_inside(tmp_path, old_kernel)
    allowed = {"out", "scratch", "private tmp", "private shm"}  # the machine's /tmp and /dev/shm: never
    written = {name for name, did in wrote.items() if did}
    assert written == allowed, (
        f"wrote {sorted(written - allowed)}; could not write {sorted(allowed - written)}"
    )
    for name in ("job", "inputs", "repository", "suite", "interpreter"):
        assert seen["read_only"][seen["places"][name]], f"the {name} folder is on a writable mount"
    ours = {"/proc", "/tmp", "/dev/shm", *(seen["places"][n] for n in ("out", "scratch"))}
    loose = sorted(point for point, flags in seen["mounts"].items() if flags != "ro" and point not in ours)
    assert not loose, f"mounts left writable in the worker: {loose}"


@pytest.mark.parametrize("old_kernel", [False, True], ids=["mount_setattr", "remount-each"])
def test_the_machine_wide_knobs_of_proc_stay_read_only(tmp_path: Path, old_kernel: bool) -> None:
    seen, _ = _look_inside(tmp_path, old_kernel)
    knobs = [p for p in PROC_KNOBS if os.path.exists(p)]
    assert knobs and all(seen["read_only"][p] for p in knobs), {p: seen["read_only"].get(p) for p in knobs}


def test_the_walls_hold_where_the_machine_has_namespaces() -> None:
    """The walls' own probe (a worker that must write its ``out/`` and its private ``/tmp``, and must not
    write the folder around its job) passes wherever namespaces can be made: walls that fail it would
    leave every repository graded without them (the subreapers alone), and every walled test skipped."""
    assert namespaces_work(), "namespaces can be made here, yet the walls' probe says they do not hold"
