"""Byte units, defined once. ``MB`` in this suite means MiB (2**20 bytes), as torch DDP's
``bucket_cap_mb`` and the handout's DDP tests read ``bucket_size_mb``; the all-reduce sizes "1MB".."1GB"
are 2**20..2**30 bytes. Only the accounting's card capacities ("80GB") are decimal."""

from __future__ import annotations

import re
from typing import Any

MIB = 2**20
GIB = 2**30


def mb_to_bytes(mb: float) -> int:
    """``bucket_size_mb`` / ``bucket_cap_mb`` / ``chunk_mb`` -> bytes (MiB)."""
    return int(mb * MIB)


def parse_size(value: Any) -> float | None:
    """Bytes of a size given as a number or a label like "1MB", "10 MiB", "1GB" (binary either way:
    the labels name the all-reduce sizes 2**20..2**30); None when it is not a size."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)i?B?\s*", str(value), re.IGNORECASE)
    if not m:
        return None
    number, prefix = float(m.group(1)), m.group(2).upper()
    return number * 1024 ** ("KMGT".index(prefix) + 1 if prefix else 0)
