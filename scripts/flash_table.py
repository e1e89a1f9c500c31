"""Compact tables from the issue-14 GPU runs (pytest-benchmark JSON):

    python scripts/flash_table.py RESULTS.json [RESULTS.json ...]

Attention shapes rows: per shape and pass, ms of ours and each SDPA backend, ours / flash, ours / cuDNN
and our TFLOP/s. Model rows: mean, std and median ms per case.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")


def _benchmarks(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())["benchmarks"]


def _row(shape: str, pass_: str, impls: dict[str, dict]) -> str:
    ms = {i: impls.get(i, {}).get("do_bench_ms") for i in IMPLS}
    cells = [f"{ms[i]:.3f}" if ms[i] else impls.get(i, {}).get("status", "-") for i in IMPLS]
    ours = ms["flash_triton"]
    ratios = [f"{ours / ms[i]:.2f}" if ours and ms[i] else "-" for i in ("sdpa_flash", "sdpa_cudnn")]
    tflops = impls.get("flash_triton", {}).get("tflops")
    return f"| {shape} | {pass_} | {' | '.join(cells)} | {' | '.join(ratios)} | {tflops or 0:.0f} |"


def shapes_table(path: str) -> None:
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for b in _benchmarks(path):
        e = b["extra_info"]
        if e.get("group_key") == "attention_shapes":
            rows[(e["shape"], e["pass_"])][e["impl"]] = e
    if not rows:
        return
    print("| shape | pass | ours ms | flash | cuDNN | mem-eff | ours/flash | ours/cuDNN | ours TFLOP/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (shape, pass_), impls in rows.items():
        print(_row(shape, pass_, impls))


def model_table(path: str) -> None:
    cases = [b for b in _benchmarks(path) if b["extra_info"].get("mean_ms") and "size" in b["extra_info"]]
    if not cases:
        return
    print("\n| model case | mean ms | std ms | std % | median ms |")
    print("|---|---|---|---|---|")
    for b in cases:
        e = b["extra_info"]
        mean, std = e["mean_ms"], e["std_ms"]
        name = b["name"].split("[")[-1].rstrip("]")
        print(f"| {name} | {mean:.2f} | {std:.2f} | {100 * std / mean:.1f} | {e.get('median_ms', 0):.2f} |")


if __name__ == "__main__":
    for results in sys.argv[1:]:
        shapes_table(results)
        model_table(results)
