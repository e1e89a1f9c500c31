"""Forced config sets side by side (issue 14): is a bench run's ratio the tuner's choice or the machine?

For each case, config sets (fwd, dQ pass, dK/dV pass) chosen by earlier runs are forced in turn, three
interleaved rounds each: CUDA-graph fwd+bwd and fwd (fresh leaves per capture, as the bench does),
do_bench backward, and a torch.profiler pass of each kernel's device time. Writes config-pairs.json.

    python scripts/flash_config_pairs.py --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

import torch
from flash_device_check import kernel_device_us  # scripts/ is on sys.path when run as a script
from triton.testing import do_bench

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash_attention as kernels
from cs336_systems.profiling.timing import graph_time

# (batch, heads, seq, d, causal) -> set name -> (fwd, dq, dkdv): the choices of sessions 7 and 8.
CASES = {
    (2, 16, 8192, 64, False): {
        "A_s7": ("q64-k64-w4-s4-tma", "q128-k64-w4-s4-tma", "q32-k64-w4-s3-tma"),
        "B_s8": ("q128-k64-w8-s3-tma", "q64-k64-w4-s3-tma", "q64-k64-w4-s3-tma"),
        "fwdA_bwdB": ("q64-k64-w4-s4-tma", "q64-k64-w4-s3-tma", "q64-k64-w4-s3-tma"),
        "fwdB_bwdA": ("q128-k64-w8-s3-tma", "q128-k64-w4-s4-tma", "q32-k64-w4-s3-tma"),
    },
    (1, 16, 16384, 64, True): {
        "split_s8": ("q64-k64-w4-s4-tma", "q64-k64-w4-s3-tma", "q64-k64-w4-s4-tma"),
        "split_s7c3": ("q64-k64-w4-s4-tma", "q128-k64-w4-s4-tma", "q64-k64-w4-s3-tma"),
        "one_pass": ("q64-k64-w4-s4-tma", "q64-k64-w4-s3-tma", "q64-k64-w4-s4-tma-adq"),
    },
}


def parse(name: str) -> kernels.TileConfig:
    """``q64-k64-w4-s3-tma[-adq]`` (TileConfig's str) back to a TileConfig."""
    q, k, w, s, *flags = name.split("-")
    return kernels.TileConfig(int(q[1:]), int(k[1:]), int(w[1:]), int(s[1:]), "tma" in flags, "adq" in flags)


def run_case(shape: tuple, sets: dict[str, tuple[str, str, str]], rounds: int = 3) -> dict:
    b, h, n, d, causal = shape
    g = torch.Generator("cuda").manual_seed(0)
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = (mk().requires_grad_() for _ in range(3))
    do = mk()
    times = {name: {"graph_fwd_bwd": [], "graph_fwd": [], "bwd": []} for name in sets}
    kernels_us = {}
    for r in range(rounds):
        for name, configs in sets.items():
            for kernel, c in zip(("fwd", "dq", "dkdv"), configs, strict=True):
                kernels.force_config(kernel, parse(c))

            def step(q=q, k=k, v=v):
                FlashAttentionTriton.apply(q, k, v, causal).backward(do)

            step()  # plans and compiles outside any capture
            # Fresh leaves for the capture: AccumulateGrad nodes made on the default stream break it.
            fresh = [x.detach().clone().requires_grad_() for x in (q, k, v)]
            times[name]["graph_fwd_bwd"].append(
                graph_time(lambda f=fresh: step(*f), rep_ms=300, grad_to_none=fresh)
            )
            times[name]["graph_fwd"].append(
                graph_time(lambda: FlashAttentionTriton.apply(q, k, v, causal), rep_ms=200)
            )
            o = FlashAttentionTriton.apply(q, k, v, causal)
            times[name]["bwd"].append(
                do_bench(lambda o=o: o.backward(do, retain_graph=True), rep=200, grad_to_none=[q, k, v])
            )
            if r == 0:
                kernels_us[name] = kernel_device_us(step, (q, k, v), width=40)
    for kernel in ("fwd", "dq", "dkdv"):
        kernels.force_config(kernel, None)
    medians = {name: {m: round(statistics.median(t), 4) for m, t in ms.items()} for name, ms in times.items()}
    return {"median_ms": medians, "rounds_ms": times, "kernel_us": kernels_us}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    out = {}
    for shape, sets in CASES.items():
        out[str(shape)] = run_case(shape, sets)
        print(shape, json.dumps(out[str(shape)]["median_ms"], indent=1), flush=True)
    with open(os.path.join(args.out, "config-pairs.json"), "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
