"""Tuning tables shipped with the package: each GPU model's tuned configs per tuning key, as vLLM ships its
fused-MoE configs per device.

Why: a cold key costs its candidates' compiles (seconds of the compiled xl step's cold start), and near-tie
choices flip between processes. A key in the table takes its config without compiling or timing the others; a
key not in it is tuned as before. Measured: docs/perf-notes.md, FlashAttention-2, "A tuning table shipped per
GPU model".

A table is data a command wrote on that GPU (``python -m cs336_systems.cli.flash_tune``), one JSON file
per device name in ``tuned/``. It is used only with the Triton ``major.minor`` it was tuned with (another
compiler may rank the configs differently), and an entry only while its config is still one of its key's
candidates.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import triton

from .configs import TileConfig, gpu_candidate_configs, key_str, parse_key
from .settings import INTERPRET

TABLES = Path(__file__).parent / "tuned"


def table_path(device_name: str, folder: Path = TABLES) -> Path:
    """``NVIDIA H100 80GB HBM3`` -> ``tuned/NVIDIA_H100_80GB_HBM3.json``."""
    return folder / (re.sub(r"[^A-Za-z0-9]+", "_", device_name).strip("_") + ".json")


def triton_minor(version: str = triton.__version__) -> str:
    return ".".join(version.split(".")[:2])


@dataclass
class TuneTable:
    """The configs by tuning key of one device's table, with where they came from and, when the table is
    not used, why."""

    entries: dict[tuple, TileConfig] = field(default_factory=dict)
    path: str | None = None
    why_not: str | None = None

    def describe(self) -> dict[str, Any]:
        return {"path": self.path, "keys": len(self.entries), "why_not_used": self.why_not}


def read_table(path: Path, triton_version: str = triton.__version__) -> TuneTable:
    """The table at ``path``; empty (with the reason) when missing or tuned with another Triton."""
    if not path.exists():
        return TuneTable(path=str(path), why_not="no table for this device")
    data = json.loads(path.read_text())
    if data.get("triton") != triton_minor(triton_version):
        why = f"tuned with triton {data.get('triton')}, this is {triton_minor(triton_version)}"
        return TuneTable(path=str(path), why_not=why)
    entries = {parse_key(text): TileConfig(**cfg) for text, cfg in data["keys"].items()}
    return TuneTable(entries, str(path))


def write_table(path: Path, entries: Mapping[tuple, TileConfig], meta: Mapping[str, Any]) -> None:
    """Merge ``entries`` into the table at ``path`` (a key tuned again replaces its entry)."""
    old = json.loads(path.read_text()) if path.exists() else {}
    # Another compiler's choices do not carry over.
    kept = old.get("keys", {}) if old.get("triton") == meta.get("triton") else {}
    keys = {**kept, **{key_str(k): asdict(c) for k, c in entries.items()}}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({**meta, "keys": dict(sorted(keys.items()))}, indent=1) + "\n")


def stale_entries(table: TuneTable) -> list[str]:
    """Keys whose config is no longer among their GPU candidates (ignored when looked up)."""
    entries = table.entries.items()
    return [key_str(key) for key, cfg in entries if cfg not in gpu_candidate_configs(key[0], key[4], key[6])]


def table_for_device(device_name: str, folder: Path = TABLES) -> TuneTable:
    """The table shipped for exactly this GPU model, or an empty one: another model's table (an H100
    PCIe taking the H100 SXM's, say) would pick configs tuned for other clocks, memory and SM counts."""
    return read_table(table_path(device_name, folder))


@functools.cache
def device_table() -> TuneTable:
    """This process's GPU's shipped table (read once); empty without a GPU."""
    if INTERPRET or not torch.cuda.is_available():
        return TuneTable(why_not="no GPU")
    return table_for_device(torch.cuda.get_device_name())
