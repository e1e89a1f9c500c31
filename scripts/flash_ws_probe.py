"""Probe: does Triton 3.6's automatic warp specialization on Hopper (``tl.range(warp_specialize=True)``)
speed up an attention forward at d = 128? A minimal forward with 2-D descriptors (contiguous
(batch*heads*N, d) rows, N a multiple of the tiles), timed against the same kernel without it, against
the suite's tuned forward and against SDPA cuDNN, in one process.

Hopper's pass (triton 3.6) only fires for one loop per kernel with no code after it that uses dots, and
only for 4-warp kernels, which it splits into a producer warp group plus two consumer warp groups of
half the query tile each (setmaxnreg 40 / 232). So the causal case runs one loop with the mask on every
tile (``ONE_LOOP``), where the suite's kernels run an unmasked loop and then the diagonal tiles.

    python scripts/flash_ws_probe.py --out $OUT

Finding (H100, torch 2.11, triton 3.6; docs/results/issue14/h100-ws-probe.json): the warp-specialized
builds compile (a CPU build for sm_90a shows the producer/consumer split and setmaxnreg 40/232), but the
first one launched, non-causal q128-k128-w4-s2, never finished: the watchdog ended the process after
45 s. Two loops in one kernel (the suite's causal structure), or a descriptor store of the partitioned
output tile, do not compile at all.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import threading
import time

import torch
import triton
import triton.language as tl
import triton.testing
from triton.tools.tensor_descriptor import TensorDescriptor

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))


# fmt: off
@triton.jit
def _tiles(acc, l_i, m_i, q, desc_k, desc_v, base, offs_q, lo, hi, qk_scale, BN: tl.constexpr,
           MASKED: tl.constexpr, WS: tl.constexpr):
    for start in tl.range(lo, hi, BN, warp_specialize=WS):
        k = desc_k.load([base + start, 0])
        v = desc_v.load([base + start, 0])
        s = tl.dot(q, k.T)
        if MASKED:
            offs_k = start + tl.arange(0, BN)
            s = s * qk_scale + tl.where(offs_k[None, :] > offs_q[:, None], -1.0e6, 0.0)
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
        else:
            m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
            p = tl.exp2(s * qk_scale - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def probe_fwd(desc_q, desc_k, desc_v, O, L, N, scale, D: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
              CAUSAL: tl.constexpr, ONE_LOOP: tl.constexpr, WS: tl.constexpr):
    start_m = (tl.num_programs(0) - 1 - tl.program_id(0)) * BM
    base = tl.program_id(1) * N
    q = desc_q.load([base + start_m, 0])
    offs_q = start_m + tl.arange(0, BM)
    qk_scale = scale * 1.4426950408889634
    acc = tl.zeros((BM, D), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    if CAUSAL:
        if ONE_LOOP:
            acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, base, offs_q, 0, start_m + BM, qk_scale, BN,
                                   True, WS)
        else:
            acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, base, offs_q, 0, start_m, qk_scale, BN,
                                   False, WS)
            acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, base, offs_q, start_m, start_m + BM,
                                   qk_scale, BN, True, False)
    else:
        acc, l_i, m_i = _tiles(acc, l_i, m_i, q, desc_k, desc_v, base, offs_q, 0, N, qk_scale, BN, False, WS)
    acc = acc / l_i[:, None]
    rows = (base + offs_q).to(tl.int64)
    tl.store(L + rows, (m_i + tl.log2(l_i)) * 0.6931471805599453)
    cols = tl.arange(0, D)
    tl.store(O + rows[:, None] * D + cols[None, :], acc.to(O.dtype.element_ty))

# fmt: on


def probe(q, k, v, causal, bm, bn, warps, stages, one_loop, ws):
    b, h, n, d = q.shape
    flat = [t.reshape(b * h * n, d) for t in (q, k, v)]
    descs = [TensorDescriptor.from_tensor(t, [r, d]) for t, r in zip(flat, (bm, bn, bn), strict=True)]
    o = torch.empty_like(q)
    lse = torch.empty(b, h, n, device=q.device, dtype=torch.float32)
    grid = (n // bm, b * h)

    def run():
        probe_fwd[grid](
            *descs,
            o,
            lse,
            n,
            1.0 / math.sqrt(d),
            D=d,
            BM=bm,
            BN=bn,
            CAUSAL=causal,
            ONE_LOOP=one_loop,
            WS=ws,
            num_warps=warps,
            num_stages=stages,
        )

    return run, o


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default=".")
    args = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from cs336_systems.kernels import flash_attention as fa

    shapes = [
        (2, 32, 4096, 128, False),
        (2, 32, 4096, 128, True),
        (1, 32, 16384, 128, True),
        (2, 16, 8192, 64, False),
        (1, 16, 16384, 64, True),
    ]
    variants = []
    for bm, bn in ((128, 128), (128, 64)):
        for stages in (2, 3):
            variants.append((bm, bn, 4, stages, True, True))  # WS, one masked loop
            variants.append((bm, bn, 8, stages, False, False))  # plain two loops, 8 warps
            variants.append((bm, bn, 4, stages, True, False))  # one loop, no WS (the mask's cost)
    # Plain variants first, warp-specialized ones last; a variant that hangs the GPU (a producer/consumer
    # barrier never arriving) is reported by a watchdog, which then ends the process.
    variants.sort(key=lambda v: v[5])
    rows: list[dict] = []
    out_path = os.path.join(args.out, "ws-probe.json")
    state = {"label": "start", "t": time.monotonic()}

    def watchdog() -> None:
        while True:
            time.sleep(2)
            if time.monotonic() - state["t"] > 45:
                rows.append({"variant": state["label"], "error": "no progress in 45 s (hang)"})
                print(json.dumps(rows[-1]), flush=True)
                with open(out_path, "w") as f:
                    json.dump(rows, f, indent=1)
                os._exit(3)

    threading.Thread(target=watchdog, daemon=True).start()
    for b, h, n, d, causal in shapes:
        state.update(label=f"{(b, h, n, d, causal)} ours/cudnn", t=time.monotonic())
        torch.manual_seed(0)
        q, k, v = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            sdpa = functools.partial(
                torch.nn.functional.scaled_dot_product_attention, q, k, v, is_causal=causal
            )
            cudnn = triton.testing.do_bench(sdpa, rep=200)
        fa.flash_forward(q, k, v, causal)  # tunes
        ours = triton.testing.do_bench(functools.partial(fa.flash_forward, q, k, v, causal), rep=200)
        base = dict(shape=[b, h, n, d, causal], cudnn_ms=cudnn, ours_ms=ours)
        chosen = fa.chosen_configs(b * h, n, n, d, causal, q.dtype)["fwd"]
        rows.append({**base, "variant": "ours (tuned)", "ms": ours, "chosen": chosen})
        print(json.dumps(rows[-1]), flush=True)
        for bm, bn, warps, stages, one_loop, ws in variants:
            if not causal and one_loop and not ws:
                continue
            name = (
                f"q{bm}-k{bn}-w{warps}-s{stages}"
                + ("-ws" if ws else "")
                + ("-oneloop" if one_loop and causal else "")
            )
            state.update(label=f"{(b, h, n, d, causal)} {name}", t=time.monotonic())
            try:
                run, o = probe(q, k, v, causal, bm, bn, warps, stages, one_loop and causal, ws)
                run()
                torch.cuda.synchronize()
                err = ((o.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                ms = triton.testing.do_bench(run, rep=200)
                rows.append(
                    {
                        **base,
                        "variant": name,
                        "ms": ms,
                        "rel_err": err,
                        "vs_cudnn": ms / cudnn,
                        "vs_ours": ms / ours,
                    }
                )
            except Exception as e:  # a probe records what fails
                rows.append({**base, "variant": name, "error": f"{type(e).__name__}: {str(e)[-300:]}"})
            print(json.dumps(rows[-1]), flush=True)
    with open(out_path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
