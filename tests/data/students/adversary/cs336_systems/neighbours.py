"""What a repository graded beside others would try on a shared machine: find every listening TCP port
(``/proc/net/tcp``, ``/proc/net/tcp6``) in the range the kernel hands out for port 0, where the other
repositories' rendezvous stores and gloo pairs are, and connect to each. It connects and closes; a real
attacker would then speak the store's protocol. A listener of its own, opened first, stands for this
repository's store: it must be seen and reached, or the scan proves nothing."""

from __future__ import annotations

import socket
from pathlib import Path

LISTEN = "0A"  # the socket state column of /proc/net/tcp


def _address(hex_address: str) -> str:
    """The loopback address that reaches a socket bound to ``hex_address`` (``/proc/net/tcp``'s form:
    32-bit words in host order); a wildcard is reached on loopback."""
    raw = b"".join(bytes.fromhex(hex_address[i : i + 8])[::-1] for i in range(0, len(hex_address), 8))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    if raw == bytes(len(raw)):
        return "127.0.0.1" if family == socket.AF_INET else "::1"
    return socket.inet_ntop(family, raw)


def listening() -> list[tuple[str, int]]:
    """(address, port) of every listening TCP socket visible here in the kernel's port-0 range."""
    low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            address, port = local.rsplit(":", 1)
            if state == LISTEN and low <= int(port, 16) <= high:
                found.append((_address(address), int(port, 16)))
    return sorted(set(found))


def reach_all() -> str:
    """Connect to every listening port found; one line saying which were seen and which reached."""
    with socket.create_server(("127.0.0.1", 0)) as own:
        reached = []
        seen = listening()
        for address, port in seen:
            try:
                socket.create_connection((address, port), timeout=0.5).close()
                reached.append(port)
            except OSError:
                pass
        return f"own {own.getsockname()[1]}; seen {[p for _, p in seen]}; reached {reached}"
