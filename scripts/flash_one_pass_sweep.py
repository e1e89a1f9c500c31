"""The one-pass backward (dQ added atomically by the dK/dV pass) against the split backward, per tile config.

    python scripts/flash_one_pass_sweep.py --out DIR [--budget-s 240] [--d 64,128]

For each shape (bf16, (batch, heads, seq, d), causal or not): the split backward as tuned over the short
lists under ``torch.use_deterministic_algorithms`` (split candidates only) is the reference; then the
dK/dV pass pinned to each config of ``CONFIGS`` (split and one-pass, Triton and Gluon): its dQ/dK/dV
against the reference's (relative error), and do_bench medians of the backward (ms), with the dQ pass
tuned. Writes ``one_pass.json`` under --out after every row.
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
SHAPES = [
    (1, 16, 16384, 64, True),  # the leaderboard
    (1, 2, 16384, 64, True),
    (8, 12, 2048, 64, True),
    (2, 16, 8192, 64, False),
    (4, 25, 512, 64, True),  # the xl model
    (1, 32, 32768, 128, True),
    (2, 32, 4096, 128, True),
]
G = lambda q, k, w, atomic_dq=False: C(q, k, w, 2, True, atomic_dq, gluon=True)
CONFIGS = {
    128: [
        C(64, 128, 8, 3, True),  # split, Triton
        G(64, 64, 4),  # split, Gluon
        C(32, 64, 4, 3, True, True),  # one pass, Triton
        G(64, 128, 8, True),  # one pass, Gluon: two warp groups split the 128 keys
        G(64, 64, 4, True),
    ],
    64: [
        C(64, 64, 4, 4, True),  # split, Triton
        G(64, 64, 4),  # split, Gluon
        C(64, 64, 4, 4, True, True),  # one pass, Triton
        G(64, 64, 4, True),  # one pass, Gluon
        G(64, 128, 8, True),
    ],
}


def sweep_shape(shape: tuple, rows: list[dict], save, deadline: float) -> None:
    b, h, n, d, causal = shape
    q, k, v, do = make((b, h, n, d))
    o, lse = kernels.flash_forward(q, k, v, causal)
    backward = lambda: kernels.flash_backward(q, k, v, o, do, lse, causal)
    torch.use_deterministic_algorithms(True)
    try:
        ref = backward()  # tunes the split backward
        split = {"shape": shape, "config": "split (tuned)", "bwd_ms": bench(backward)}
        split["chosen"] = kernels.chosen_configs(b * h, n, n, d, causal, q.dtype)
    finally:
        torch.use_deterministic_algorithms(False)
    rows.append(split)
    print(split, flush=True)
    for config in CONFIGS[d]:
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
    ap.add_argument("--d", default="64,128", help="head dims to sweep")
    args = ap.parse_args()
    dims = {int(x) for x in args.d.split(",")}
    args.out.mkdir(parents=True, exist_ok=True)
    deadline = time.perf_counter() + args.budget_s
    rows: list[dict] = []
    save = lambda: (args.out / "one_pass.json").write_text(json.dumps(rows, indent=1))
    for shape in (s for s in SHAPES if s[3] in dims):
        sweep_shape(shape, rows, save, deadline)
        torch.cuda.empty_cache()
    save()


if __name__ == "__main__":
    main()
