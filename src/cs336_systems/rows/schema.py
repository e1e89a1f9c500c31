"""The contract between ``bench/`` and the report: every benchmark group, declared once.

A bench names its group through :func:`tag`, never with a string of its own; the report routes rows on
the ``deliverable`` and ``group_key`` that :func:`tag` writes into ``extra_info``. A test checks that every
group a bench emits is declared here and that every declared group is emitted by some bench, so a renamed
group fails a test instead of silently emptying a writeup section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BenchGroup:
    key: str  # stable identifier, stored in extra_info["group_key"]
    deliverable: str  # deliverable id(s) of docs/deliverables.md, e.g. "D11" or "D14-D17"
    title: str  # what the group measures, as a reader sees it

    def name(self, detail: str = "") -> str:
        """The pytest-benchmark group name: deliverable, title and an optional detail (e.g. the size)."""
        return " ".join(part for part in (self.deliverable, self.title, detail) if part)


_GROUPS = (
    BenchGroup("model", "D2/D4/D7b", "model"),
    BenchGroup("warmup", "D2", "warm-up"),
    BenchGroup("profile", "D3", "profile"),
    BenchGroup("memory", "D5", "memory"),
    BenchGroup("attention", "D6/D7a", "attention eager vs compiled"),
    BenchGroup("flash_sweep", "D11", "flash sweep"),
    BenchGroup("leaderboard", "D12", "leaderboard"),
    BenchGroup("attention_shapes", "D12", "attention shapes"),
    BenchGroup("allreduce", "D13", "all-reduce"),
    BenchGroup("ddp", "D14-D17", "DDP"),
    BenchGroup("sharding", "D20", "sharding"),
    BenchGroup("checkpointing", "D22", "activation checkpointing"),
    BenchGroup("fused_loss", "D26", "fused LM-head cross-entropy"),
    BenchGroup("fused_adamw", "D26", "fused AdamW"),
    BenchGroup("fsdp", "D23/D24", "FSDP"),
    BenchGroup("leaderboard_2026", "D26", "2026 leaderboard step"),
    BenchGroup("leaderboard_2026_ablation", "D26", "2026 leaderboard ablation"),
    BenchGroup("proxy_8b", "D26", "8B per-GPU proxy"),
    BenchGroup("grading", "", "grading one repository"),  # the grader itself, no deliverable of the handout
)
GROUPS: dict[str, BenchGroup] = {g.key: g for g in _GROUPS}


def group(key: str) -> BenchGroup:
    try:
        return GROUPS[key]
    except KeyError:
        raise KeyError(
            f"unknown bench group {key!r}; declare it in rows/schema.py ({sorted(GROUPS)})"
        ) from None


def tag(benchmark: Any, key: str, detail: str = "") -> None:
    """Name ``benchmark``'s group after the declared group ``key`` and record its deliverable id."""
    g = group(key)
    benchmark.group = g.name(detail)
    benchmark.extra_info["group_key"] = g.key
    benchmark.extra_info["deliverable"] = g.deliverable
