"""Compact tables from the issue-14 GPU runs (pytest-benchmark JSON):

    python scripts/flash_table.py RESULTS.json [RESULTS.json ...]

Attention shapes rows: per shape and pass, ms of ours and each SDPA backend (median of interleaved
rounds), ours / flash and ours / cuDNN (paired by round), the same from CUDA-graph replays (device time
only), and our TFLOP/s. Model rows: mean, std and median ms per case.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient")
REFERENCES = ("sdpa_flash", "sdpa_cudnn")


def _benchmarks(path: str) -> list[dict]:
    return json.loads(Path(path).read_text())["benchmarks"]


def _ms(impls: dict[str, dict], key: str) -> list[str]:
    cells = []
    for i in IMPLS:
        e = impls.get(i, {})
        cells.append(f"{e[key]:.3f}" if e.get(key) else e.get("status", "-") if key == "do_bench_ms" else "-")
    return cells


def _ratio(ours: dict, ms_key: str, ratio_key: str, impls: dict[str, dict], ref: str) -> str:
    # Our rows hold the paired (per-round) ratio; older JSON only the two medians.
    if ratio_key in ours:
        return f"{ours[ratio_key]:.2f}"
    a, b = ours.get(ms_key), impls.get(ref, {}).get(ms_key)
    return f"{a / b:.2f}" if a and b else "-"


def _row(shape: str, pass_: str, impls: dict[str, dict]) -> str:
    ours = impls.get("flash_triton", {})
    cells = _ms(impls, "do_bench_ms")
    cells += [_ratio(ours, "do_bench_ms", f"ratio_to_{r}", impls, r) for r in REFERENCES]
    cells += _ms(impls, "graph_ms")[:3]
    cells += [_ratio(ours, "graph_ms", f"graph_ratio_to_{r}", impls, r) for r in REFERENCES]
    return f"| {shape} | {pass_} | {' | '.join(cells)} | {ours.get('tflops') or 0:.0f} |"


def shapes_table(path: str) -> None:
    rows: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for b in _benchmarks(path):
        e = b["extra_info"]
        if e.get("group_key") == "attention_shapes":
            shape = e["shape"] + (" (breadth)" if e.get("shape_set") == "breadth" else "")
            rows[(shape, e["pass_"])][e["impl"]] = e
    if not rows:
        return
    print(
        "| shape | pass | ours ms | flash | cuDNN | mem-eff | ours/flash | ours/cuDNN "
        "| graph: ours ms | flash | cuDNN | ours/flash | ours/cuDNN | ours TFLOP/s |"
    )
    print("|---" * 14 + "|")
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
