"""Where the model's time goes with each attention (issue 14): one GPU command.

    python scripts/model_attention_diag.py --out DIR [--size xl] [--ctx 512] [--steps 20]
    python scripts/model_attention_diag.py --out DIR --paired small,xl [--steps 40] [--cudagraphs]

For the model (bf16 autocast, forward+backward) compiled with inductor, and with CUDA graphs
(``mode="reduce-overhead"``), per attention (sdpa, flash_triton): per-step device time (CUDA events) and host
enqueue time (the step's Python, no sync), then one profiled window: GPU time per kernel class.
Host-bound when host >= device (the host cost of one eager attention call: scripts/flash_host_overhead.py).
Writes ``model_attention_diag.json``; a table last.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from cs336_systems.kernels import flash_attention as kernels
from cs336_systems.profiling.timing import gc_paused, summarize_ms
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
    case = Case(size, ctx, "fwd_bwd", "bf16", True, attention, cudagraphs=mode == "cudagraphs")
    work = Workload(case, "cuda")
    try:
        res = time_steps(work, steps)
        res.update(profile_steps(work))
    except Exception as exc:  # a variant that fails is a result, not the end of the run
        res = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
    work.close()
    return res


def paired(size: str, ctx: int, steps: int, cudagraphs: bool = False) -> dict:
    """Both attentions' compiled models (``cudagraphs``: mode="reduce-overhead"), steps alternated (see
    the module docstring)."""
    works = {
        a: Workload(Case(size, ctx, "fwd_bwd", "bf16", True, a, cudagraphs=cudagraphs), "cuda")
        for a in ("sdpa", "flash_triton")
    }
    for work in works.values():
        for _ in range(5):  # compiles, tunes
            work.step()
    torch.cuda.synchronize()
    times: dict[str, list[float]] = {a: [] for a in works}
    with gc_paused():
        for i in range(steps):
            for name in list(works)[:: 1 if i % 2 == 0 else -1]:
                t0 = time.perf_counter()
                works[name].step()
                torch.cuda.synchronize()
                times[name].append((time.perf_counter() - t0) * 1e3)
    for work in works.values():
        work.close()
    result = {a: {**summarize_ms(t), "ms": t} for a, t in times.items()}
    ours, ref = times["flash_triton"], times["sdpa"]
    result["ratio_of_means"] = statistics.fmean(ours) / statistics.fmean(ref)
    result["ratio_of_medians"] = statistics.median(ours) / statistics.median(ref)
    result["median_pair_ratio"] = statistics.median(o / r for o, r in zip(ours, ref, strict=True))
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="xl")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--modes", default="inductor,cudagraphs")
    ap.add_argument("--paired", help="sizes, e.g. small,xl: compiled sdpa and flash_triton, steps alternated")
    ap.add_argument("--cudagraphs", action="store_true", help="--paired with CUDA graphs (reduce-overhead)")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.paired:
        result = {"device": torch.cuda.get_device_name(), "ctx": args.ctx, "steps": args.steps}
        result["cudagraphs"] = args.cudagraphs
        for size in args.paired.split(","):
            result[size] = paired(size, args.ctx, args.steps, args.cudagraphs)
        result["tuning"] = kernels.tuning_report()
        name = "model_attention_paired" + ("_cudagraphs" if args.cudagraphs else "")
        (args.out / f"{name}.json").write_text(json.dumps(result, indent=1, default=str))
        how = "compiled with CUDA graphs" if args.cudagraphs else "compiled"
        print(f"\nctx{args.ctx} bf16 fwd_bwd {how}, {args.steps} alternated steps each")
        print(
            "size | sdpa mean ± std (median) ms | flash_triton mean ± std (median) ms | ratio of means | medians"
        )
        for size in args.paired.split(","):
            r = result[size]
            cell = lambda a, r=r: f"{r[a]['mean_ms']:.2f} ± {r[a]['std_ms']:.2f} ({r[a]['median_ms']:.2f})"
            print(f"{size} | {cell('sdpa')} | {cell('flash_triton')} | {r['ratio_of_means']:.3f} | "
                  f"{r['ratio_of_medians']:.3f}")  # fmt: skip
        return
    result = {"device": torch.cuda.get_device_name(), "size": args.size, "ctx": args.ctx}
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
