"""Probe: the Gluon dK/dV pass (kernels/flash_bwd_gluon.py) against the suite's Triton dK/dV pass, on the
grid's shapes: dK/dV agreement and device time per config.

    python scripts/flash_gluon_probe.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import triton.testing

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
sys.path.insert(0, os.path.dirname(__file__))

from flash_device_check import kernel_device_us

from cs336_systems.harness.attention import ATTENTION_SHAPES
from cs336_systems.kernels import flash_attention as fa

SHAPES = ATTENTION_SHAPES  # (batch, heads, seq_q, seq_k, d, causal); --shapes indexes it
CONFIGS = {
    128: [(64, 64, 4), (64, 128, 8), (32, 64, 4)],
    64: [(64, 64, 4), (64, 128, 8), (128, 128, 8), (32, 64, 4)],
}


def probe(shape, out) -> None:
    b, h, nq, nk, d, causal = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(b, h, nk, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    do = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
    o, lse = fa.flash_forward(q, k, v, causal)
    _, dk_ref, dv_ref = fa.flash_backward(q, k, v, o, do, lse, causal)
    delta = (o.float() * do.float()).sum(-1)
    plan = fa.attention_plan(q, k, v, causal, pointers=False)

    def suite_bwd():
        fa.flash_backward(q, k, v, o, do, lse, causal)

    kernels = kernel_device_us(suite_bwd, [], reps=5)
    res = {
        "shape": shape,
        "suite_kernels_us": kernels,
        "suite_configs": fa.chosen_configs(*plan.case),
        "gluon": {},
    }
    res["suite_bwd_ms"] = triton.testing.do_bench(suite_bwd, warmup=50, rep=300)
    for bm, bn, w in CONFIGS[d]:
        config = fa.TileConfig(bm, bn, w, 2, tma=True, gluon=True)
        name = str(config)
        dk = torch.empty_like(k)
        dv = torch.empty_like(v)
        call = fa._dkdv_call(config, causal, q, k, v, do, lse, delta, dk, dv)
        assert call.fn is fa.flash_bwd_gluon.flash_bwd_dkdv_gluon_kernel, "the Gluon pass does not apply here"
        try:
            t0 = time.time()
            call.jit()
            torch.cuda.synchronize()
            compile_s = time.time() - t0
            err = {
                n: ((x.float() - r.float()).norm() / r.float().norm()).item()
                for n, x, r in (("dK", dk, dk_ref), ("dV", dv, dv_ref))
            }
            ms = triton.testing.do_bench(call.jit, warmup=50, rep=300)
            device_us = kernel_device_us(call.jit, [], reps=5)
            res["gluon"][name] = {"ms": ms, "device_us": device_us, "err": err, "compile_s": compile_s}
        except Exception as e:  # a config that does not build is a result, not a crash
            res["gluon"][name] = {"error": f"{type(e).__name__}: {str(e)[-400:]}"}
        print(shape, name, res["gluon"][name], flush=True)
    print(shape, "suite", {k: v for k, v in kernels.items() if "bwd" in k}, flush=True)
    out.write(json.dumps(res) + "\n")
    out.flush()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--shapes", default=",".join(map(str, range(len(SHAPES)))))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "gluon-probe.jsonl"), "w") as out:
        for i in map(int, args.shapes.split(",")):
            probe(SHAPES[i], out)


if __name__ == "__main__":
    main()
