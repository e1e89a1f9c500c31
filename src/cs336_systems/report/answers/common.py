"""What every answer module shares: byte units, their Markdown, the card capacity of a device name,
and the rows of one measured setting.

Nothing here imports torch: the report reads JSON, and only the closed forms (which count a model's
parameters) need :mod:`cs336_systems.accounting`, imported inside the functions that use it.
"""

from __future__ import annotations

import re

from cs336_systems.report.load import Record
from cs336_systems.units import GIB, MIB

MiB, GiB, GB = MIB, GIB, 10**9
H100_BYTES = 80 * GiB  # accounting.H100_BYTES (a test checks they agree)


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def device_capacity_bytes(device: str) -> int:
    """HBM of the card a device name denotes ("NVIDIA H100 80GB HBM3" says it; an H200 has 141 GB);
    80 GiB when the name does not tell."""
    m = re.search(r"(\d+)\s*GB", device)
    if m:
        return int(m.group(1)) * 2**30
    if "H200" in device:
        return 141 * 10**9
    return H100_BYTES


def _settings(rows: list[Record], *keys: str) -> dict[tuple, list[Record]]:
    """Rows grouped by device and the descriptors ``keys`` (one measured setting each)."""
    out: dict[tuple, list[Record]] = {}
    for r in rows:
        out.setdefault((r.device, *(r.descriptors.get(k) for k in keys)), []).append(r)
    return out
