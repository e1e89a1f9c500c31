"""Inside a worker's namespaces, before the graded code starts: the whole filesystem read-only, except
the job's own scratch. ``python -I -S mounts.py SPEC_JSON -- COMMAND...`` (standard library only: it
runs before anything of the grader or the student is importable), then it becomes ``COMMAND``.

An allow-list, not a block-list: every mount is made read-only (recursively, one ``mount_setattr`` call
where the kernel has it, else each mount of ``/proc/self/mountinfo`` remounted; ``/proc`` itself excepted,
not its machine-wide knobs), and only then are the
writable places mounted back, each a bind of its own: the job's ``out/``, the repository's scratch (its
``HOME`` and compile caches), a private ``/tmp`` and ``/dev/shm`` (the job's own folders; the ranks of one
job share them, as NCCL's shared memory needs). Folders that vanish under the private ``/tmp`` (the job's
folder lives there) are bound back at their paths, read-only. The other repositories of a class are
covered by an empty read-only ``tmpfs`` (nothing to read, nothing to change), and so is ``/run``, where
the sockets of the machine's services live (a uid-0 worker without capabilities could still ask systemd
or Docker to run something outside).

Exit status 126 with one line on stderr when a step fails: the command never runs half-walled. Where
the spec names a ``ready_fd`` (a pipe to the grader), the outcome goes there too, "ok" or the failure,
before the command starts: the graded code cannot write it (the pipe is closed first, and its only
other holders are this namespace's PID 1 and processes outside it), so a failing worker cannot pass
itself off as a sandbox that failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import sys

MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 0x1, 0x2, 0x4, 0x8
MS_REMOUNT, MS_BIND, MS_REC = 0x20, 0x1000, 0x4000
AT_FDCWD, AT_RECURSIVE = -100, 0x8000
MOUNT_ATTR_RDONLY = 0x1
SYS_MOUNT_SETATTR = 442  # the same number on x86_64 and aarch64 (the generic syscall table)
SETUP_FAILED = 126
# /proc stays writable (CUDA's initialisation writes there: error 304 without it), but not what a uid-0
# process without capabilities could still change machine-wide through it (sysctls, sysrq, IRQs): the
# paths Docker makes read-only.
PROC_READ_ONLY = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")

LIBC = ctypes.CDLL(None, use_errno=True)


class MountAttr(ctypes.Structure):
    _fields_ = [
        ("attr_set", ctypes.c_uint64),
        ("attr_clr", ctypes.c_uint64),
        ("propagation", ctypes.c_uint64),
        ("userns_fd", ctypes.c_uint64),
    ]


class SetupError(Exception):
    pass


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    enc = lambda s: s.encode() if s is not None else None
    _check(LIBC.mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _setattr(path: str, set_: int, clear: int, recursive: bool) -> bool:
    """``mount_setattr(2)``; False where the kernel has no such call (before 5.12)."""
    attr = MountAttr(set_, clear, 0, 0)
    flags = AT_RECURSIVE if recursive else 0
    res = LIBC.syscall(
        SYS_MOUNT_SETATTR, AT_FDCWD, path.encode(), flags, ctypes.byref(attr), ctypes.sizeof(attr)
    )
    if res != 0 and ctypes.get_errno() == 38:  # ENOSYS
        return False
    _check(res, f"mount_setattr {path}")
    return True


def _kept_flags(path: str) -> int:
    """The flags a remount of ``path`` must keep (a user namespace locks them)."""
    st = os.statvfs(path)
    kept = 0
    for bit, flag in ((os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC)):
        if st.f_flag & bit:
            kept |= flag
    return kept


def _mount_points() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    decoded = [p.encode().decode("unicode_escape") for p in points]  # "\040" is a space
    return sorted(set(decoded), key=lambda p: p.count("/"))


def read_only_everywhere() -> None:
    if _setattr("/", MOUNT_ATTR_RDONLY, 0, recursive=True):
        return
    for point in _mount_points():
        try:
            flags = MS_REMOUNT | MS_BIND | MS_RDONLY | _kept_flags(point)
            _mount(None, point, None, flags)
        except (SetupError, OSError) as exc:
            if os.path.exists(point):  # one that went away meanwhile is no hole
                raise SetupError(f"cannot make {point} read-only ({exc})") from None


def _writable(path: str) -> None:
    if not _setattr(path, 0, MOUNT_ATTR_RDONLY, recursive=False):
        _mount(None, path, None, MS_REMOUNT | MS_BIND | _kept_flags(path))


def _bind(fd: int, target: str, writable: bool) -> None:
    """Mount the folder held open as ``fd`` at ``target`` (made first where it no longer exists: under
    the private ``/tmp``), read-only unless ``writable``."""
    os.makedirs(target, exist_ok=True)
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | (0 if writable else MS_REC))
    if writable:
        _writable(target)


def _related(a: str, b: str) -> bool:
    return a == b or a.startswith(b.rstrip("/") + "/") or b.startswith(a.rstrip("/") + "/")


def _cover(path: str) -> None:
    """An empty, read-only tmpfs over ``path``: whatever was there is neither readable nor writable."""
    _mount("tmpfs", path, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=4k,mode=0555")


def setup(spec: dict) -> None:
    """The walls ``spec`` describes; with ``"read_only": false`` only the private ``/tmp`` and ``/dev/shm``
    (an observer's own view: it and the process it observes meet there)."""
    keep, writable = spec.get("keep", []), spec.get("writable", [])
    private = {"/tmp": spec["tmp"], "/dev/shm": spec.get("shm")}
    # Every folder is opened before anything covers it: the binds below come from these handles.
    opened = {p: os.open(p, os.O_PATH | os.O_DIRECTORY) for p in [*keep, *writable, *private.values()] if p}
    if spec.get("read_only", True):
        for path in filter(os.path.exists, PROC_READ_ONLY):  # mounts of their own: they stay read-only
            _mount(path, path, None, MS_BIND | MS_REC)
        read_only_everywhere()
        _writable("/proc")
    for target, source in private.items():
        if source and os.path.isdir(target):
            _bind(opened[source], target, writable=True)
    for path in sorted(set(keep), key=lambda p: p.count("/")):
        if any(_related(path, t) for t in private):  # covered by the private /tmp: bound back
            _bind(opened[path], path, writable=False)
    for path in sorted(set(writable), key=lambda p: p.count("/")):
        _bind(opened[path], path, writable=True)
    ours = [*keep, *writable]
    for path in [*spec.get("hidden", []), *spec.get("masked", [])]:
        if os.path.isdir(path) and not os.path.islink(path) and not any(_related(path, o) for o in ours):
            _cover(path)
    for fd in opened.values():
        os.close(fd)
    if spec.get("cwd"):
        os.chdir(spec["cwd"])


def _tell(fd: int | None, message: str) -> None:
    """The outcome to the grader's pipe (an observer in between may not pass the pipe on: then nothing)."""
    if fd is None:
        return
    try:
        os.write(fd, message.encode()[:4000])
        os.close(fd)
    except OSError:
        pass


def main(argv: list[str]) -> int:
    spec, command = json.loads(argv[1]), argv[3:]
    try:
        setup(spec)
    except (SetupError, OSError, KeyError) as exc:
        print(f"sandbox setup failed: {exc}", file=sys.stderr)
        _tell(spec.get("ready_fd"), f"sandbox setup failed: {exc}")
        return SETUP_FAILED
    _tell(spec.get("ready_fd"), "ok")
    os.execvp(command[0], command)
    return SETUP_FAILED  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv))
