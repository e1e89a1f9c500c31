"""Keeping the graded code inside its job: nothing it starts outlives the job, and it cannot write the
grader's folders.

Two layers. Every grading process that starts graded code (the judge, a repository's job, a class run)
is a child subreaper (``become_subreaper``): whatever the graded code leaves behind, double-forked and
``setsid`` included, is re-parented to it rather than to PID 1, and ``kill_descendants`` stops all of it
before any result file is written. Where the machine allows (root, or unprivileged user namespaces, and
util-linux's ``unshare`` and ``setpriv``), each worker also starts in PID and mount namespaces of its own
(``Sandbox.wrap``): it sees only its own processes (not the grader's command lines), the grader's folders
are read-only there except the job's ``out/``, it holds no capability to undo that, and when its first
process exits the kernel kills everything left in it; elsewhere the subreapers alone hold. And each
repository's ``repo_job`` runs on a network of its own with only loopback (``network.py``): its ranks
talk over loopback TCP there, and no other repository's ports are reachable. ``isolation()`` says which
of these the machine gave.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import pwd
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from . import network as net
from .settings import namespaces_wanted, protected_from_env, worker_user_from_env

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


@dataclass(frozen=True)
class Sandbox:
    """How workers start: ``protect`` are folders a worker must not write (read-only in its mount
    namespace); ``worker_user`` runs the workers as that user when this process is root."""

    protect: tuple[Path, ...] = ()
    worker_user: str | None = None
    namespaces: bool = True  # False: subreapers only, even where namespaces work
    network: str | None = None  # "own" or "shared"; None: as this process has it (``network.here``)

    @staticmethod
    def from_env() -> Sandbox:
        """The grading run's sandbox, as its parent (``repo_job``, a class run) passed it on."""
        protect = tuple(Path(p) for p in protected_from_env())
        return Sandbox(protect, worker_user_from_env(), namespaces_wanted())

    def isolation(self) -> dict[str, object]:
        """What this sandbox gives on this machine, for ``grade.json``."""
        kind = NAMESPACES if self.uses_namespaces() else SUBREAPER
        covers = (
            "each worker in PID and mount namespaces of its own, the grader's folders read-only, no "
            "capabilities; every process it leaves behind is killed with it"
            if kind == NAMESPACES
            else "every process the graded code leaves behind is killed before any result is written "
            "(no PID and mount namespaces here: needs root or unprivileged user namespaces, and util-linux)"
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

    def prepare(self, folder: Path) -> None:
        """Hand the job folder's ``out/`` to the worker user (when there is one)."""
        user = self._user()
        if user is None:
            return
        entry = pwd.getpwnam(user)
        folder.chmod(0o755)
        for path in (folder, *folder.rglob("*")):
            path.chmod(path.stat().st_mode | 0o044 | (0o011 if path.is_dir() else 0))
        os.chown(folder / "out", entry.pw_uid, entry.pw_gid)

    def wrap(self, cmd: list[str], writable: list[Path]) -> list[str]:
        """``cmd`` as it starts in this sandbox: in its own namespaces where they work, ``writable``
        the only folders of ``protect`` it may write; else unchanged (the worker user still applies)."""
        user = self._setpriv_user()
        if not self.uses_namespaces():
            return ["setpriv", *user, "--", *cmd] if user else cmd
        script = _mount_script([*self.protect, jobs_parent()], writable)
        drop = ["setpriv", "--no-new-privs", "--inh-caps=-all", "--ambient-caps=-all"]
        drop += ["--bounding-set=-all", *user, "--", *cmd]
        # A shell is the namespace's PID 1 and the worker its child: PID 1 ignores the signals it has no
        # handler for (an abort() would not end the worker); the shell passes the status on (128 + n).
        script += f"{shlex.join(drop)}\nexit $?\n"
        return [*_unshare(), "sh", "-c", script]

    def _setpriv_user(self) -> list[str]:
        user = self._user()
        return [f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--init-groups"] if user else []


def returncode(code: int | None, wrapped: bool) -> int | None:
    """A worker's exit status as if it ran unwrapped: the shell of ``wrap`` says death by signal n as
    128 + n."""
    if wrapped and code is not None and 128 < code <= 128 + 64:
        return -(code - 128)
    return code


def _mount_script(protect: list[Path], writable: list[Path]) -> str:
    lines = ["set -e"]
    # The writable folders are mounts of their own first: the read-only bind of a folder above them
    # (recursive) keeps them as they are, and they stay writable.
    lines += [f"mount --bind {shlex.quote(str(w))} {shlex.quote(str(w))}" for w in writable]
    for path in dict.fromkeys(p.resolve() for p in protect if p.exists()):
        q = shlex.quote(str(path))
        lines += [f"mount --rbind {q} {q}", f"mount -o remount,bind,ro {q}"]
    return "\n".join(lines) + "\n"


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
    """Whether a process started here can have PID and mount namespaces, mount a folder read-only
    and drop its capabilities (tried once, on a folder of its own)."""
    if not (shutil.which("unshare") and shutil.which("setpriv")):
        return False
    with tempfile.TemporaryDirectory(prefix="cs336-probe-") as tmp:
        probe = Path(tmp)
        (probe / "out").mkdir()
        script = _mount_script([probe], [probe / "out"])
        script += "setpriv --no-new-privs --inh-caps=-all --bounding-set=-all -- sh -c "
        script += shlex.quote(f"touch {tmp}/out/ok; touch {tmp}/bad 2>/dev/null; exit 0")
        try:
            subprocess.run([*_unshare(), "sh", "-c", script], capture_output=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return False
        return (probe / "out" / "ok").exists() and not (probe / "bad").exists()


@functools.cache
def jobs_parent() -> Path:
    """The folder this process's worker jobs are made in (read-only to every worker but its own
    ``out/``: one job's code cannot write another's records)."""
    folder = Path(tempfile.mkdtemp(prefix="cs336-jobs-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    folder.chmod(0o711)  # a worker user finds its own job by name, and lists nothing
    return folder
