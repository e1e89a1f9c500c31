"""Keeping the graded code inside its job: nothing it starts outlives the job, and it can write nothing
but its own scratch.

Two layers. Every grading process that starts graded code (the judge, a repository's job, a class run)
is a child subreaper (``become_subreaper``): whatever the graded code leaves behind, double-forked and
``setsid`` included, is re-parented to it rather than to PID 1, and ``kill_descendants`` stops all of it
before any result file is written. Where the machine allows (root, or unprivileged user namespaces, and
util-linux's ``unshare`` and ``setpriv``), each worker also starts in PID and mount namespaces of its own
(``Sandbox.wrap``): it sees only its own processes (not the grader's command lines); the whole filesystem
is read-only there except its job's ``JobFolder`` (``out/``, a private ``/tmp`` and ``/dev/shm``) and its
repository's scratch (``HOME``, the Triton and inductor caches: never another repository's), the class's
other repositories are not there at all (``mounts.py``); it holds no capability to undo that, and when
its first process exits the kernel kills everything left in it. Elsewhere the subreapers alone hold, and
``walls.py`` says what stays writable. And each repository's ``repo_job`` runs on a network of its own
with only loopback (``network.py``). ``isolation()`` says which of these the machine gave.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import json
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import network as net
from .settings import hidden_from_env, namespaces_wanted, scratch_from_env, worker_user_from_env

PR_SET_CHILD_SUBREAPER = 36
NAMESPACES, SUBREAPER = "namespaces", "subreaper"


def become_subreaper() -> bool:
    """Orphans of this process's descendants are re-parented here instead of to PID 1 (Linux only)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _parents() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, state) of every process visible in /proc."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, ppid = stat[stat.rindex(")") + 2 :].split()[:2]  # the name may hold spaces and ')'
        found[int(entry)] = (int(ppid), state)
    return found


def descendants(root: int | None = None, keep: frozenset[int] = frozenset()) -> list[int]:
    """Living (not zombie) descendants of ``root`` (this process), leaving out the trees under ``keep``."""
    table = _parents()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    todo, found = [os.getpid() if root is None else root], []
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in keep:
                found.append(child)
                todo.append(child)
    return [p for p in found if table[p][1] != "Z"]


def kill_descendants(
    timeout: float = 10.0, root: int | None = None, keep: frozenset[int] = frozenset()
) -> list[int]:
    """SIGKILL every descendant of ``root`` (this process) outside ``keep``'s trees, reap the ones that
    are this process's children, and repeat until none is left (a process may fork while it is being
    killed). What was still alive at ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        left = descendants(root, keep)
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        _reap(keep)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def _reap(keep: frozenset[int]) -> None:
    """Reap this process's dead children outside ``keep`` (orphans re-parented here; a child another
    owner waits for, such as a ``Popen`` in ``keep``, is left to it)."""
    me = os.getpid()
    for pid, (ppid, state) in _parents().items():
        if ppid == me and state == "Z" and pid not in keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)


MOUNTS = Path(__file__).resolve().parent / "mounts.py"
SETUP_FAILED = 126  # mounts.py's exit status when a wall could not be built (the command never ran)
MASKED = ("/run", "/var/run")  # the machine's service sockets (systemd, Docker): not the worker's to reach


@dataclass(frozen=True)
class JobFolder:
    """One job's folder: what the grader gives it (``job.json``, ``inputs/``: read-only to the job), its
    ``out/`` and ``tmp/`` (its ``/tmp``), and its ``/dev/shm`` (on the machine's shared-memory tmpfs where
    there is one: NCCL maps its segments there). Every rank of the job shares them."""

    path: Path
    shm: Path

    @property
    def out(self) -> Path:
        return self.path / "out"

    @property
    def tmp(self) -> Path:
        return self.path / "tmp"

    @staticmethod
    def make(parent: Path, prefix: str = "job-") -> JobFolder:
        path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        (path / "out").mkdir()
        (path / "tmp").mkdir()
        shm_root = Path("/dev/shm")
        if shm_root.is_dir() and os.access(shm_root, os.W_OK):
            shm = Path(tempfile.mkdtemp(prefix=f"cs336-{path.name}-", dir=shm_root))
        else:
            (shm := path / "shm").mkdir()
        return JobFolder(path, shm)

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        shutil.rmtree(self.shm, ignore_errors=True)


@dataclass(frozen=True)
class Sandbox:
    """How workers start: ``worker_user`` runs them as that user when this process is root; ``hidden``
    are the class's other repositories (not visible to the workers); ``scratch`` is this repository's
    ``HOME`` and compile caches, the one place its workers write that outlives a job."""

    worker_user: str | None = None
    namespaces: bool = True  # False: subreapers only, even where namespaces work
    network: str | None = None  # "own" or "shared"; None: as this process has it (``network.here``)
    hidden: tuple[Path, ...] = ()
    scratch: Path | None = None  # None: this process's own (``repo_scratch``)

    @staticmethod
    def from_env() -> Sandbox:
        """The grading run's sandbox, as its parent (``repo_job``, a class run) passed it on."""
        hidden = tuple(Path(p) for p in hidden_from_env())
        scratch = scratch_from_env()
        return Sandbox(
            worker_user_from_env(),
            namespaces_wanted(),
            hidden=hidden,
            scratch=Path(scratch) if scratch else None,
        )

    def isolation(self) -> dict[str, object]:
        """What this sandbox gives on this machine, for ``grade.json``."""
        kind = NAMESPACES if self.uses_namespaces() else SUBREAPER
        covers = (
            "each worker in PID and mount namespaces of its own, the whole filesystem read-only but its job's "
            "scratch and its repository's caches, the class's other repositories hidden, no capabilities; "
            "every process it leaves behind is killed with it"
            if kind == NAMESPACES
            else "every process the graded code leaves behind is killed before any result is written; the "
            "filesystem is not walled (no PID and mount namespaces here: needs root or unprivileged user "
            "namespaces, and util-linux)"
        )
        network = self.network or net.here()
        covers += (
            "; the repository on a network of its own, loopback only: no other repository's ports"
            if network == net.OWN
            else "; the network is shared: other repositories' ports can be reached"
        )
        return {"isolation": kind, "network": network, "covers": covers, "worker_user": self._user()}

    def uses_namespaces(self) -> bool:
        return self.namespaces and namespaces_work()

    def _user(self) -> str | None:
        return self.worker_user if self.worker_user and os.geteuid() == 0 else None

    def home(self) -> Path:
        return (self.scratch or repo_scratch()) / "home"

    def env(self) -> dict[str, str]:
        """The variables that point the graded code at its own scratch: its ``HOME``, caches and
        ``TMPDIR``, the repository's, kept across its jobs (inductor keeps its precompiled headers under
        ``TMPDIR`` whatever its cache says: a folder per job rebuilt them in every job, 8 s each on the
        2-core CPU). ``/tmp`` itself is the job's."""
        scratch = self.scratch or repo_scratch()
        return {
            "HOME": str(self.home()),
            "TMPDIR": str(scratch / "tmp"),
            "XDG_CACHE_HOME": str(self.home() / ".cache"),
            "TRITON_CACHE_DIR": str(scratch / "triton"),
            "TORCHINDUCTOR_CACHE_DIR": str(scratch / "inductor"),
            "PYTHONDONTWRITEBYTECODE": "1",  # its own tree is read-only: no .pyc to try to write
        }

    def prepare(self, job: JobFolder) -> None:
        """The repository's scratch made, and handed with the job's writable places to the worker user
        (when there is one); the rest of the job's folder stays the grader's, readable."""
        scratch = self.scratch or repo_scratch()
        for folder in (scratch / "home", scratch / "triton", scratch / "inductor", scratch / "tmp"):
            folder.mkdir(parents=True, exist_ok=True)
        user = self._user()
        if user is None:
            return
        entry = pwd.getpwnam(user)
        job.path.chmod(0o755)
        for path in (job.path, *job.path.rglob("*")):
            path.chmod(path.stat().st_mode | 0o044 | (0o011 if path.is_dir() else 0))
        for path in (job.out, job.tmp, job.shm, scratch, *scratch.iterdir()):
            os.chown(path, entry.pw_uid, entry.pw_gid)

    def wrap(
        self, cmd: list[str], job: JobFolder, keep: list[Path], cwd: Path, ready_fd: int | None = None
    ) -> list[str]:
        """``cmd`` as it starts in this sandbox: in its own namespaces where they work, where it reads
        everything it needs (``keep``: the student's roots; the interpreter and the suite's worker are
        added here) and writes only its job's places and the repository's scratch; else unchanged (the
        worker user still applies). ``ready_fd``: a pipe (passed to the process) on which the walls say
        "ok", or why they could not be built, before ``cmd`` starts."""
        user = self._setpriv_user()
        if not self.uses_namespaces():
            return ["setpriv", *user, "--", *cmd] if user else cmd
        spec = walls_spec(job, [*keep, cwd], self.scratch or repo_scratch(), self.hidden, cwd)
        spec["ready_fd"] = ready_fd
        drop = ["setpriv", "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all"]
        drop += ["--bounding-set=-all", *user, "--", *cmd]
        setup = [sys.executable, "-I", "-S", str(MOUNTS), json.dumps(spec), "--", *drop]
        # A shell is the namespace's PID 1 and the worker its child: PID 1 ignores the signals it has no
        # handler for (an abort() would not end the worker); the shell passes the status on (128 + n).
        return [*_unshare(), "sh", "-c", f"{shlex.join(setup)}\nexit $?\n"]

    def observer(
        self, prefix: tuple[str, ...], job: JobFolder, keep: list[Path], cwd: Path, writes: tuple[Path, ...]
    ) -> list[str]:
        """``prefix`` (an observer outside the graded process: Nsight Compute) in a mount namespace whose
        ``/tmp`` and ``/dev/shm`` are the job's: the observer and the walled process it launches meet there
        (its injection finds its host through them), and neither touches the machine's. Nothing else of
        the observer's view changes; ``writes`` are the folders it writes (its report)."""
        if not prefix or not self.uses_namespaces():
            return list(prefix)
        spec = walls_spec(job, [*keep, cwd], self.scratch or repo_scratch(), (), cwd)
        # The walls inside open the job's folders by their paths, the shared-memory one included.
        writable = [*spec["writable"], spec["shm"], *map(str, writes)]
        spec |= {"read_only": False, "writable": writable, "masked": []}
        user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
        return [
            "unshare",
            *user,
            "--mount",
            sys.executable,
            "-I",
            "-S",
            str(MOUNTS),
            json.dumps(spec),
            "--",
            *prefix,
        ]

    def _setpriv_user(self) -> list[str]:
        user = self._user()
        return [f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups"] if user else []


def walls_spec(job: JobFolder, keep: list[Path], scratch: Path, hidden: tuple[Path, ...], cwd: Path) -> dict:
    """What ``mounts.py`` builds: the places a worker writes, the ones it must still read where the
    private ``/tmp`` would cover them (the job's folder, the student's roots, the interpreter and the
    grader's worker, wherever they live), and what it must not see."""
    here = Path(__file__).resolve().parent
    python = {Path(p).resolve() for p in (sys.prefix, sys.base_prefix, sys.exec_prefix)}
    path_entries = [Path(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    reads = [job.path, here, *python, *keep, *path_entries]
    return {
        "keep": [str(p.resolve()) for p in dict.fromkeys(reads) if p.exists()],
        "writable": [str(job.out.resolve()), str(scratch.resolve())],
        "tmp": str(job.tmp.resolve()),
        "shm": str(job.shm.resolve()),
        "hidden": [str(p.resolve()) for p in hidden],
        "masked": list(MASKED),
        "cwd": str(cwd.resolve()),
    }


def walls_message(read_end: int) -> str | None:
    """What ``mounts.py`` said on the pipe (read once every holder has exited): "ok", why the walls
    failed, or None where nothing came (no namespaces, or an observer that did not pass the pipe on)."""
    os.set_blocking(read_end, False)
    try:
        said = os.read(read_end, 4096).decode(errors="replace").strip()
    except BlockingIOError:
        said = ""
    finally:
        os.close(read_end)
    return said or None


def returncode(code: int | None, wrapped: bool) -> int | None:
    """A worker's exit status as if it ran unwrapped: the shell of ``wrap`` says death by signal n as
    128 + n."""
    if wrapped and code is not None and 128 < code <= 128 + 64:
        return -(code - 128)
    return code


def _unshare() -> list[str]:
    user = ["--user", "--map-root-user"] if os.geteuid() != 0 else []
    return ["unshare", *user, "--pid", "--fork", "--kill-child", "--mount-proc", "--mount"]


def describe(isolation: dict) -> str:
    """One line for the CLI: which isolation the graded code had."""
    user = f", as user {isolation['worker_user']}" if isolation.get("worker_user") else ""
    network = f", {isolation['network']} network" if isolation.get("network") else ""
    return f"isolation: {isolation['isolation']}{network}{user} ({isolation['covers']})"


@functools.cache
def namespaces_work() -> bool:
    """Whether a process started here gets the walls (``mounts.py``): tried once, a worker that must write
    its ``out/`` and its private ``/tmp`` and must not write the folder around them."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    parent = Path(tempfile.mkdtemp(prefix="cs336-probe-"))
    job = JobFolder.make(parent)
    try:
        spec = walls_spec(job, [], job.path, (), job.path)
        private = f"private-{job.path.name}"
        script = f"touch {job.out}/ok /tmp/{private} && touch {parent}/bad 2>/dev/null; exit 0"
        drop = [
            "setpriv",
            "--no-new-privs",
            "--inh-caps=-all",
            "--bounding-set=-all",
            "--",
            "sh",
            "-c",
            script,
        ]
        setup = [sys.executable, "-I", "-S", str(MOUNTS), json.dumps(spec), "--", *drop]
        try:
            subprocess.run([*_unshare(), *setup], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        walled = (job.tmp / private).exists() and not (Path("/tmp") / private).exists()
        return (job.out / "ok").exists() and walled and not (parent / "bad").exists()
    finally:
        job.remove()
        shutil.rmtree(parent, ignore_errors=True)


@functools.cache
def jobs_parent() -> Path:
    """The folder this process's worker jobs are made in (read-only to every worker but its own
    ``out/``: one job's code cannot write another's records)."""
    folder = Path(tempfile.mkdtemp(prefix="cs336-jobs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder.chmod(0o711)  # a worker user finds its own job by name, and lists nothing
    return folder


@functools.cache
def repo_scratch() -> Path:
    """This process's repository scratch where no parent made one (``repo_job`` does, for its judge,
    course tests and leaderboard alike): the graded code's ``HOME`` and compile caches."""
    from . import caches

    folder = jobs_parent() / "scratch"
    folder.mkdir(exist_ok=True)
    caches.seed_scratch(folder)
    return folder
