"""Probe: the Gluon kernels (kernels/flash_gluon.py) against the suite's Triton kernels on the grid's
shapes. Per shape and kernel (forward, dQ, dK/dV): the tuner's time of every candidate (its launch metric,
median of interleaved rounds), the best Triton and best Gluon config and their ratio, and the agreement of
O, dQ, dK and dV between the two (each kernel pinned to its best config of either kind).

    python scripts/flash_gluon_probe.py --out $OUT [--shapes 0,6]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

from cs336_systems.harness.attention import ATTENTION_SHAPES
from cs336_systems.kernels import flash_attention as fa

KERNELS = ("fwd", "dq", "dkdv")


def _run(q, k, v, do, causal) -> dict[str, torch.Tensor]:
    o, lse = fa.flash_forward(q, k, v, causal)
    dq, dk, dv = fa.flash_backward(q, k, v, o, do, lse, causal)
    return {"O": o, "dQ": dq, "dK": dk, "dV": dv}


def _best(timings: dict[str, float], gluon: bool) -> tuple[str, float] | None:
    kind = {name: ms for name, ms in timings.items() if name.endswith("-gluon") == gluon}
    return min(kind.items(), key=lambda item: item[1]) if kind else None


def _pinned(configs: dict[str, str], q, k, v, do, causal) -> dict[str, torch.Tensor]:
    by_name = {str(c): c for kernel in KERNELS for c in fa.candidate_configs(kernel, q.shape[-1], q.dtype)}
    try:
        for kernel, name in configs.items():
            fa.force_config(kernel, by_name[name])
        return _run(q, k, v, do, causal)
    finally:
        for kernel in configs:
            fa.force_config(kernel, None)


def probe(shape) -> dict:
    b, h, nq, nk, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = (torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    k, v = (torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
    _run(q, k, v, do, causal)  # tunes the three kernels
    tuned = fa.candidate_timings(b * h, nq, nk, d, causal, q.dtype)
    res: dict = {
        "shape": shape,
        "chosen": fa.chosen_configs(b * h, nq, nk, d, causal, q.dtype),
        "kernels": {},
    }
    best = {}
    for kernel in KERNELS:
        timings = tuned[kernel]
        triton_best, gluon_best = _best(timings, False), _best(timings, True)
        best[kernel] = (triton_best, gluon_best)
        res["kernels"][kernel] = {
            "timings_ms": timings,
            "best_triton": triton_best,
            "best_gluon": gluon_best,
            "gluon_over_triton": gluon_best[1] / triton_best[1] if triton_best and gluon_best else None,
        }
    if all(t and g for t, g in best.values()):
        ref = _pinned({kern: t[0] for kern, (t, _) in best.items()}, q, k, v, do, causal)
        out = _pinned({kern: g[0] for kern, (_, g) in best.items()}, q, k, v, do, causal)
        res["gluon_vs_triton_rel_err"] = {
            n: ((out[n].float() - ref[n].float()).norm() / ref[n].float().norm()).item() for n in ref
        }
    print(json.dumps({**res, "kernels": {k: {x: y for x, y in v.items() if x != "timings_ms"}
                                          for k, v in res["kernels"].items()}}), flush=True)  # fmt: skip
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=",".join(map(str, range(len(ATTENTION_SHAPES)))))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gluon-probe.jsonl"), "w") as out:
        for i in map(int, args.shapes.split(",")):
            out.write(json.dumps(probe(ATTENTION_SHAPES[i])) + "\n")
            out.flush()
    print("tune_seconds", fa.tuning_report()["tune_seconds"])


if __name__ == "__main__":
    main()
