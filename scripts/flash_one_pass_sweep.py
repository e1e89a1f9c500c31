"""The one-pass backward (dQ added atomically by the dK/dV pass) against the split backward, per tile config.

    python scripts/flash_one_pass_sweep.py --out DIR [--budget-s 240]

For each shape (bf16, causal, (batch, heads, seq, d)): the split backward as tuned over the short lists,
then the dK/dV pass pinned to each one-pass config: its dQ/dK/dV against the split's (relative error),
and do_bench medians of the backward (ms). Writes ``one_pass.json`` under --out after every row.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from flash_bwd_variants import bench, make, rel, using  # scripts/ is on sys.path when run as a script

from cs336_systems.kernels import flash_attention as kernels

C = kernels.TileConfig
SHAPES = [(1, 32, 32768, 128), (1, 16, 16384, 64), (2, 32, 4096, 128), (1, 2, 16384, 64)]
TILES = {  # (q_tile, k_tile, warps, stages): small query tiles keep dQ's share of registers small
    128: [(16, 128, 8, 3), (32, 128, 8, 2), (32, 128, 8, 3), (16, 64, 4, 3), (32, 64, 4, 3), (64, 128, 8, 2)],
    64: [(32, 64, 4, 3), (64, 64, 4, 4), (32, 128, 8, 3), (64, 128, 8, 2), (128, 128, 8, 2), (64, 64, 8, 3)],
}


def sweep_shape(shape: tuple[int, int, int, int], rows: list[dict], save, deadline: float) -> None:
    q, k, v, do = make(shape)
    o, lse = kernels.flash_forward(q, k, v, True)
    ref = kernels.flash_backward(q, k, v, o, do, lse, True)  # tunes the split backward
    backward = lambda: kernels.flash_backward(q, k, v, o, do, lse, True)
    b, h, n, d = shape
    split = {"shape": shape, "config": "split (tuned)", "bwd_ms": bench(backward)}
    split["chosen"] = kernels.chosen_configs(b * h, n, n, d, True, q.dtype)
    rows.append(split)
    print(split, flush=True)
    for tiles in TILES[d]:
        config = C(*tiles, tma=True, atomic_dq=True)
        row = {"shape": shape, "config": str(config)}
        rows.append(row)
        if time.perf_counter() > deadline:
            row["skipped"] = "budget"
            continue
        try:
            with using("dkdv", config):
                row["rel_err_vs_split"] = [rel(x, r) for x, r in zip(backward(), ref, strict=True)]
                row["bwd_ms"] = bench(backward)
                row["vs_split"] = row["bwd_ms"] / split["bwd_ms"]
        except Exception as exc:  # a config that does not build is a result
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        print(row, flush=True)
        save()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--budget-s", type=float, default=240)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    rows: list[dict] = []
    save = lambda: (args.out / "one_pass.json").write_text(json.dumps(rows, indent=1))
    for shape in SHAPES:
        sweep_shape(shape, rows, save, deadline)
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
