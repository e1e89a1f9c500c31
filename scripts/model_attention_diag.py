"""Where the model's time goes with each attention (issue 14): one GPU command.

    python scripts/model_attention_diag.py --out DIR [--size xl] [--ctx 512] [--steps 20]

For the model (bf16 autocast, forward+backward) compiled with inductor, and with CUDA graphs
(``mode="reduce-overhead"``), per attention (sdpa, flash_triton): per-step device time (CUDA events) and host
enqueue time (the step's Python, no sync), then one profiled window: GPU time per kernel class.
Host-bound when host >= device. Also the host microseconds per eager attention call at the model's
shape, direct launch against JIT dispatch. Writes ``model_attention_diag.json``; a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash_attention as kernels
from cs336_systems.profiling.workload import Case, Workload

ATTENTION_KERNELS = ("flash_fwd", "flash_bwd", "fmha", "flash_attn", "cudnn", "attention")


def time_steps(work: Workload, steps: int) -> dict:
    for _ in range(5):
        work.step()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)
    ]
    host = []
    for start, end in events:
        t0 = time.perf_counter()
        start.record()
        work.step()
        host.append((time.perf_counter() - t0) * 1e3)
        end.record()
    torch.cuda.synchronize()
    device = [s.elapsed_time(e) for s, e in events]
    return {
        "device_ms": device,
        "device_mean_ms": statistics.mean(device),
        "device_std_ms": statistics.stdev(device),
        "host_mean_ms": statistics.mean(host),
    }


def profile_steps(work: Workload, steps: int = 3) -> dict:
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            work.step()
        torch.cuda.synchronize()
    gpu = {}
    for e in prof.key_averages():
        t = e.self_device_time_total
        if t > 0 and e.device_type == torch.autograd.DeviceType.CUDA:
            gpu[e.key] = gpu.get(e.key, 0.0) + t / 1e3 / steps
    attention = {k: v for k, v in gpu.items() if any(a in k.lower() for a in ATTENTION_KERNELS)}
    top = dict(sorted(gpu.items(), key=lambda kv: -kv[1])[:6])
    return {
        "gpu_busy_ms": sum(gpu.values()),
        "attention_ms": sum(attention.values()),
        "attention_kernels_ms": attention,
        "top_kernels_ms": {k[:90]: v for k, v in top.items()},
    }


def run_model(size: str, ctx: int, attention: str, mode: str, steps: int) -> dict:
    compiled = mode == "inductor"
    work = Workload(Case(size, ctx, "fwd_bwd", "bf16", compiled, attention), "cuda")
    if mode == "cudagraphs":
        torch._dynamo.reset()
        work.forward_fn = torch.compile(work.model, mode="reduce-overhead")
    try:
        res = time_steps(work, steps)
        res.update(profile_steps(work))
    except Exception as exc:  # a variant that fails is a result, not the end of the run
        res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    work.close()
    return res


def eager_call_host_us(direct: bool, n_calls: int = 100) -> dict:
    """The model's call pattern (q, k contiguous; v a permuted view of qkv), fwd+bwd, no sync."""
    b, h, n, d = 4, 25, 512, 64
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    q, k = qkv[0].contiguous().requires_grad_(), qkv[1].contiguous().requires_grad_()
    v = qkv[2].detach().requires_grad_()
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    kernels.DIRECT_LAUNCH = direct
    step = lambda: FlashAttentionTriton.apply(q, k, v, True).backward(do)
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n_calls):
        step()
    host = (time.perf_counter() - t0) / n_calls * 1e6
    torch.cuda.synchronize()
    kernels.DIRECT_LAUNCH = True
    return {"host_us_fwd_bwd": host}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="xl")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="inductor,cudagraphs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"device": torch.cuda.get_device_name(), "size": args.size, "ctx": args.ctx}
    result["eager_call"] = {
        "direct": eager_call_host_us(True),
        "jit": eager_call_host_us(False),
    }
    print("eager call", result["eager_call"], flush=True)
    rows = {}
    for mode in args.modes.split(","):
        for attention in ("sdpa", "flash_triton"):
            name = f"{mode}/{attention}"
            rows[name] = run_model(args.size, args.ctx, attention, mode, args.steps)
            print(name, json.dumps({k: v for k, v in rows[name].items() if k != "device_ms"}), flush=True)
    result["model"] = rows
    result["tuning"] = kernels.tuning_report()
    (args.out / "model_attention_diag.json").write_text(json.dumps(result, indent=1, default=str))
    print(f"\n{args.size} ctx{args.ctx} bf16 fwd_bwd | device ms (std) | host ms | GPU busy | attention ms")
    for name, r in rows.items():
        if "error" in r:
            print(f"{name} | {r['error']}")
            continue
        print(
            f"{name} | {r['device_mean_ms']:.2f} ({r['device_std_ms']:.2f}) | {r['host_mean_ms']:.2f} | "
            f"{r['gpu_busy_ms']:.2f} | {r['attention_ms']:.2f}"
        )


if __name__ == "__main__":
    main()
