"""Print the D26 rows of a bench JSONL row log (CS336_BENCH_JSONL) or pytest-benchmark JSON as a
markdown table: step time, ratios, TFLOP/s, MFU, peak memory, cold first step.

    python scripts/leaderboard_2026_table.py runs/gpu/leaderboard_2026.jsonl
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def rows(path: Path) -> list[dict]:
    text = path.read_text()
    if path.suffix == ".jsonl":
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    return json.loads(text)["benchmarks"]


def fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def main(paths: list[str]) -> None:
    found = [
        r
        for p in paths
        for r in rows(Path(p))
        if str(r["extra_info"].get("group_key", "")).startswith("leaderboard_2026")
    ]
    ours = {
        r["extra_info"].get("mode"): r["extra_info"].get("step_s")
        for r in found
        if r["extra_info"].get("recipe") == "ours"
    }
    torch_ = {
        r["extra_info"].get("mode"): r["extra_info"].get("step_s")
        for r in found
        if r["extra_info"].get("recipe") == "torch"
    }
    print(
        "| case | step s | vs torch (same mode) | vs ours | TFLOP/s/GPU | MFU | peak alloc GiB | first step s (cold) | fwd / bwd / opt ms |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in found:
        e = r["extra_info"]
        mode = e.get("mode")
        name = e.get("recipe") or f"ours, {e.get('swap')}"
        resolved = e.get("checkpoint_resolved")
        if resolved and resolved != (e.get("pieces") or {}).get("checkpoint"):
            name += f" ({resolved})"  # keep:auto -> keep:N
        step = e.get("step_s")
        if e.get("oom"):
            print(f"| {name} {mode} | OOM | | | | | | | |")
            continue
        if step is None:
            print(
                f"| {name} {mode} | {e.get('status', '?')}: {str(e.get('reason', ''))[:80]} | | | | | | | |"
            )
            continue
        vs_torch = step / torch_[mode] if torch_.get(mode) else None
        vs_ours = step / ours[mode] if ours.get(mode) else None
        phases = " / ".join(fmt(e.get(k), ".0f") for k in ("forward_ms", "backward_ms", "optimizer_ms"))
        print(
            f"| {name} {mode} | {step:.3f} | {fmt(vs_torch, '.3f')} | {fmt(vs_ours, '.3f')} | "
            f"{fmt(e.get('tflops_per_gpu'), '.0f')} | {fmt(e.get('mfu'), '.1%')} | {fmt(e.get('peak_allocated_gib'), '.1f')} | "
            f"{fmt(e.get('first_step_since_process_start_s'), '.0f')} | {phases} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
