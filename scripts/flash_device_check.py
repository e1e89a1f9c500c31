"""One GPU command for the FlashAttention kernels (issue 14): correctness first, then timings.

    python scripts/flash_device_check.py --out DIR [--skip-grid] [--shapes 0,1,2] [--explain] [--wide]
                                         [--profile]

1. Every case of the ``attention shapes`` grid (bench/bench_flash.py): ours against SDPA's math-free
   backends on the same bf16 inputs (O, dQ, dK, dV relative error), fresh random data, outputs poisoned.
2. do_bench medians of fwd / bwd / fwd+bwd: ours, SDPA flash, SDPA cuDNN (per kernel of ours too).
3. The model's call pattern (xl: (4, 25, 512, 64), q and k contiguous, v a permuted view of qkv): host
   microseconds per call (no sync) next to device time, so per-call Python cost is visible.
4. With --explain, graph breaks of the small model under torch.compile; with --wide, tuning over the
   wide candidate sweep (what the short lists were picked from; replaces scripts/flash_tune.py --wide).
5. With --profile, the kernels of one fwd+bwd per shape (ours and SDPA cuDNN, torch.profiler, after
   warm-up): each kernel's device time, so a gap between fwd+bwd and fwd plus bwd can be placed.
Writes ``flash_check.json`` (with the tuning report: every candidate's time per key) under --out and
prints a compact table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.harness.attention import ATTENTION_SHAPES
from cs336_systems.kernels import flash_attention as kernels

GRID = ATTENTION_SHAPES  # (batch, heads, seq_q, seq_k, d, causal)
BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION}


def ours(q, k, v, causal):
    return FlashAttentionTriton.apply(q, k, v, causal)


def sdpa(backend):
    def fn(q, k, v, causal):
        with sdpa_kernel(BACKENDS[backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return fn


def rel(x, ref):
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def inputs(shape, seed=0):
    b, h, nq, nk, d, _ = shape
    g = torch.Generator("cuda").manual_seed(seed)
    mk = lambda n: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(nq), mk(nk), mk(nk)
    do = torch.randn(b, h, nq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return [t.requires_grad_() for t in (q, k, v)], do


def check(shape) -> dict:
    (q, k, v), do = inputs(shape, seed=int(time.time()) % 1000)
    causal = shape[-1]
    out = {}
    for name, fn in (("ours", ours), ("flash", sdpa("flash"))):
        for t in (q, k, v):
            t.grad = None
        o = fn(q, k, v, causal)
        o.backward(do)
        out[name] = [o.detach(), q.grad, k.grad, v.grad]
    errs = {n: rel(a, b) for n, a, b in zip(("O", "dQ", "dK", "dV"), out["ours"], out["flash"], strict=True)}
    finite = all(torch.isfinite(t).all().item() for t in out["ours"])
    return {"errors": errs, "ok": finite and max(errs.values()) < 2e-2}


def bench(fn, shape, rep=60) -> dict:
    (q, k, v), do = inputs(shape)
    causal = shape[-1]
    res = {}
    try:
        res["fwd"] = do_bench(lambda: fn(q, k, v, causal), warmup=20, rep=rep)
        o = fn(q, k, v, causal)
        res["bwd"] = do_bench(
            lambda: o.backward(do, retain_graph=True), warmup=20, rep=rep, grad_to_none=[q, k, v]
        )
        res["fwd_bwd"] = do_bench(
            lambda: fn(q, k, v, causal).backward(do), warmup=20, rep=rep, grad_to_none=[q, k, v]
        )
    except RuntimeError as exc:
        res["error"] = str(exc).splitlines()[0][:200]
    return res


def flops(shape, pass_="fwd_bwd"):
    b, h, nq, nk, d, causal = shape
    f = 4 * b * h * nq * nk * d * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[pass_]


def model_call_overhead() -> dict:
    """Host us per call for the model's layout, and the device time of the same call."""
    b, h, n, d = 4, 25, 512, 64
    x = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16)
    qkv = x.permute(2, 0, 3, 1, 4)
    q, k = qkv[0].contiguous().requires_grad_(), qkv[1].contiguous().requires_grad_()
    v = qkv[2].detach().requires_grad_()  # strided view, like the model's
    do = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous()
    do = do.transpose(1, 2)  # the layout autograd hands back through out.transpose(1, 2).reshape(...)
    res = {}
    outs = {}
    for name, fn in (("ours", ours), ("flash", sdpa("flash"))):
        for t in (q, k, v):
            t.grad = None
        o = fn(q, k, v, True)
        o.backward(do)
        outs[name] = [o.detach(), q.grad, k.grad, v.grad]
    res["check"] = [rel(a, b) for a, b in zip(outs["ours"], outs["flash"], strict=True)]
    assert max(res["check"]) < 2e-2, res["check"]
    for name, fn in (("ours", ours), ("flash", sdpa("flash")), ("cudnn", sdpa("cudnn"))):
        step = lambda fn=fn: fn(q, k, v, True).backward(do)
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        n_calls = 50
        t0 = time.perf_counter()
        for _ in range(n_calls):
            step()
        host_us = (time.perf_counter() - t0) / n_calls * 1e6
        torch.cuda.synchronize()
        res[name] = {"host_us_fwd_bwd": host_us, "device_ms_fwd_bwd": do_bench(step, grad_to_none=[q, k, v])}
    return res


def kernel_device_us(step, grads, reps: int = 5, width: int = 90) -> dict[str, float]:
    """Device microseconds per call of each kernel that ``step`` launches (torch.profiler), with the
    ``grads`` tensors' .grad reset before each call; kernel names cut to ``width`` characters."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            for t in grads:
                t.grad = None
            step()
        torch.cuda.synchronize()
    return {
        e.key[:width]: round(e.device_time_total / reps, 1)
        for e in prof.key_averages()
        if e.device_time_total
    }


def kernel_profile(shape) -> dict:
    """Device microseconds per fwd+bwd of each kernel that ours and SDPA cuDNN launch."""
    (q, k, v), do = inputs(shape)
    causal = shape[-1]
    res = {}
    for name, fn in (("ours", ours), ("cudnn", sdpa("cudnn"))):

        def step(fn=fn):
            for t in (q, k, v):
                t.grad = None
            fn(q, k, v, causal).backward(do)

        for _ in range(3):
            step()
        torch.cuda.synchronize()
        kernels_us = kernel_device_us(step, (q, k, v))
        res[name] = dict(sorted(kernels_us.items(), key=lambda kv: -kv[1]))
        res[name]["total_us"] = round(sum(kernels_us.values()), 1)
    return res


def explain_model(attention: str) -> dict:
    """Graph count and break reasons of the small model (ctx 512, bf16 autocast) under torch.compile."""
    from cs336_systems.profiling.workload import Case, Workload

    work = Workload(Case("small", 512, "fwd_bwd", "bf16", False, attention), "cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ex = torch._dynamo.explain(work.model)(work.inputs)
    reasons = sorted({str(b.reason).splitlines()[0][:160] for b in ex.break_reasons})
    work.close()
    return {"graphs": ex.graph_count, "breaks": ex.graph_break_count, "reasons": reasons[:8]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--shapes", default=",".join(map(str, range(len(GRID)))))
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--explain", action="store_true", help="graph breaks of the small model, both attentions")
    ap.add_argument("--wide", action="store_true", help="tune over the wide candidate sweep (slow)")
    ap.add_argument("--profile", action="store_true", help="per-kernel device time of one fwd+bwd per shape")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    shapes = [GRID[int(i)] for i in args.shapes.split(",")]
    if args.wide:
        kernels.CANDIDATE_SET = "wide"
    result = {"device": torch.cuda.get_device_name(), "checks": {}, "grid": {}}

    t0 = time.perf_counter()
    for shape in shapes:  # correctness first (also compiles and tunes: timed as the cold-cache cost)
        result["checks"][str(shape)] = check(shape)
        print("check", shape, result["checks"][str(shape)], flush=True)
    result["cold_tune_and_check_s"] = time.perf_counter() - t0
    print(f"cold compile+tune+check over {len(shapes)} shapes: {result['cold_tune_and_check_s']:.1f} s")

    if args.explain:
        result["explain"] = {a: explain_model(a) for a in ("flash_triton", "sdpa")}
        print("explain", result["explain"], flush=True)
    if args.profile:
        result["profile"] = {str(shape): kernel_profile(shape) for shape in shapes}
        for key, row in result["profile"].items():
            print("profile", key, json.dumps(row, indent=1), flush=True)
    result["model_call"] = model_call_overhead()
    print("model call", result["model_call"], flush=True)

    if not args.skip_grid:
        for shape in shapes:
            row = {name: bench(fn, shape) for name, fn in (("ours", ours), *((b, sdpa(b)) for b in BACKENDS))}
            result["grid"][str(shape)] = row
            print(shape, json.dumps(row), flush=True)
    result["tuning"] = kernels.tuning_report() if hasattr(kernels, "tuning_report") else {}
    (args.out / "flash_check.json").write_text(json.dumps(result, indent=1, default=str))

    print("\nshape | ours f/b/fb ms | flash fb | cudnn fb | ours/flash | ours/cudnn | TFLOP/s ours")
    for key, row in result["grid"].items():
        o, f, c = row["ours"], row["flash"], row["cudnn"]
        fb = lambda r: r.get("fwd_bwd", float("nan"))
        print(
            f"{key} | {o.get('fwd', 0):.3f}/{o.get('bwd', 0):.3f}/{fb(o):.3f} | {fb(f):.3f} | {fb(c):.3f} | "
            f"{fb(o) / fb(f):.2f} | {fb(o) / fb(c):.2f} | {flops(eval(key)) / fb(o) / 1e9:.0f}"
        )
    for name, r in result["model_call"].items():
        if name == "check":
            print("model-call check rel err O, dQ, dK, dV:", [f"{e:.1e}" for e in r])
            continue
        print(
            f"model-call {name}: host {r['host_us_fwd_bwd']:.0f} us, device {r['device_ms_fwd_bwd']:.3f} ms"
        )
    bad = [k for k, c in result["checks"].items() if not c["ok"]]
    print("CHECKS", "FAILED: " + ", ".join(bad) if bad else "all ok", f"({statistics.mean([1])})"[:0])


if __name__ == "__main__":
    main()
