"""Each repository's grading on a network of its own: a network namespace with only loopback, up.

A class run grades repositories side by side on one machine, and a job of several ranks rendezvouses on a
store the runner hosts and talks gloo (or NCCL) over loopback. On a shared network one repository's code
sees the others' ports (``/proc/net/tcp``) and can connect to their stores and pairs, and so change their
verdicts. ``repo_job`` therefore starts by moving itself to a new network namespace (``isolate``): the
judge, its stores, every worker and rank of that repository, the course's tests and the leaderboard are
its descendants and share it; no other repository is in it.

Python 3.11 has no ``os.unshare``: libc's ``unshare(2)`` through ctypes. A namespace is a thread's, not a
process's, and a process of several threads cannot make a user namespace: this runs before anything
starts a thread (importing torch does).
"""

from __future__ import annotations

import ctypes
import fcntl
import functools
import os
import socket
import struct
import subprocess
import sys
from pathlib import Path

from .settings import network_from_env, set_network

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
SIOCGIFFLAGS, SIOCSIFFLAGS = 0x8913, 0x8914
IFF_UP = 0x1
IFREQ = "16sh22x"  # struct ifreq: the interface's name, then a union whose first member is the flags
OWN, SHARED = "own", "shared"
# gloo otherwise binds the address the host name resolves to, absent here (it falls back to loopback,
# with a warning); NCCL takes loopback anyway when it is the only interface. Said, not left to chance.
INTERFACE_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def isolate(wanted: bool) -> str:
    """Put this process on a network of its own when ``wanted`` and the machine allows; ``OWN`` or
    ``SHARED``, recorded in the environment its children inherit (``here``). Where the namespace cannot
    be made, grading goes on on the shared network, and says why on stderr."""
    set_network(None)
    if not wanted:
        return SHARED
    if why := enter_own_network():
        print(f"grading on the shared network: {why}", file=sys.stderr)
        return SHARED
    set_network(namespace_id())
    os.environ.update(dict.fromkeys(INTERFACE_VARS, "lo"))
    return OWN


def enter_own_network() -> str | None:
    """Move this process to a new network namespace and bring its loopback up; why not, when it cannot
    (nothing changed then). Not root: in a user namespace of its own too, this uid and gid mapped to
    themselves, so that its children hold no capability once they exec (root keeps its own user)."""
    if (threads := len(os.listdir("/proc/self/task"))) > 1:
        return f"this process already runs {threads} threads (a namespace would be one thread's)"
    uid, gid = os.geteuid(), os.getegid()  # read first: unmapped, they read as the overflow id
    flags = CLONE_NEWNET | (0 if uid == 0 else CLONE_NEWUSER)  # the user namespace is made first
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        failed = libc.unshare(flags) != 0
    except (OSError, AttributeError) as exc:
        return f"no unshare(2) here ({exc})"
    if failed:
        return f"unshare: {os.strerror(ctypes.get_errno())}"
    # From here this process is on the new network and cannot go back: a failure is loud.
    if flags & CLONE_NEWUSER:
        map_to_self(uid, gid)
    loopback_up()
    return None


def map_to_self(uid: int, gid: int) -> None:
    """The new user namespace's only ids: this uid and gid, as outside (not root there). ``setgroups``
    denied first: the kernel asks it before an unprivileged process writes ``gid_map``."""
    Path("/proc/self/setgroups").write_text("deny")
    Path("/proc/self/uid_map").write_text(f"{uid} {uid} 1")
    Path("/proc/self/gid_map").write_text(f"{gid} {gid} 1")


def loopback_up() -> None:
    """Set ``lo`` up (a new network namespace's loopback starts down), by ioctl: no ``ip`` binary."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        got = fcntl.ioctl(sock, SIOCGIFFLAGS, struct.pack(IFREQ, b"lo", 0))
        flags = struct.unpack(IFREQ, got)[1]
        fcntl.ioctl(sock, SIOCSIFFLAGS, struct.pack(IFREQ, b"lo", flags | IFF_UP))


def namespace_id() -> str:
    """This process's network namespace, as the kernel names it (``net:[4026532281]``)."""
    return os.readlink("/proc/self/ns/net")


def here() -> str:
    """``OWN`` when this process is on the network its ``repo_job`` made (an inherited record that names
    another namespace does not count), else ``SHARED``."""
    return OWN if network_from_env() == namespace_id() else SHARED


def expected(wanted: bool) -> str:
    """The network a ``repo_job`` started from here would have (for a class run's first line)."""
    return OWN if wanted and can_isolate() else SHARED


@functools.cache
def can_isolate() -> bool:
    """Whether a process started here can enter a network of its own (tried once, in a child)."""
    probe = [sys.executable, "-m", "cs336_systems.grading.network"]
    try:
        return subprocess.run(probe, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _probe() -> int:
    """Enter a network of its own and reach a listener there on 127.0.0.1: 0 if all went well."""
    if why := enter_own_network():
        print(why, file=sys.stderr)
        return 1
    with socket.create_server(("127.0.0.1", 0)) as server:
        socket.create_connection(server.getsockname(), timeout=5).close()
    return 0


if __name__ == "__main__":
    sys.exit(_probe())
