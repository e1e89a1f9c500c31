"""Where the model's time goes with each attention (issue 14): one GPU command.

    python scripts/model_attention_diag.py --out DIR [--size xl] [--ctx 512] [--steps 20]
    python scripts/model_attention_diag.py --out DIR --paired small,xl [--steps 40] [--cudagraphs]
    python scripts/model_attention_diag.py --out DIR --stalls xl [--attentions sdpa,flash_triton]
    python scripts/model_attention_diag.py --out DIR --kernels xl [--attentions sdpa,flash_triton/opaque] \
        [--modes inductor]

For the model (bf16 autocast, forward+backward) compiled with inductor, and with CUDA graphs
(``mode="reduce-overhead"``), per attention (sdpa, flash_triton): per-step device time (CUDA events) and host
enqueue time (the step's Python, no sync), then one profiled window: GPU time per kernel class.
Host-bound when host >= device (the host cost of one eager attention call: scripts/flash_host_overhead.py).
Writes ``model_attention_diag.json``; a table last.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
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


def timed_step(work: Workload) -> dict[str, float]:
    """One synchronized step: wall ms, host ms until ``step()`` returns (enqueue, no sync) and device ms
    (CUDA events around it). wall >> usual with host >> usual: the GPU waited for the host."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    work.step()
    end.record()
    host_ms = (time.perf_counter() - t0) * 1e3
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3
    return {"wall_ms": wall_ms, "host_ms": host_ms, "device_ms": start.elapsed_time(end)}


def profile_steps(work: Workload, steps: int = 3, top: int = 6) -> dict:
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
    ranked = dict(sorted(gpu.items(), key=lambda kv: -kv[1])[:top])
    return {
        "gpu_busy_ms": sum(gpu.values()),
        "attention_ms": sum(attention.values()),
        "attention_kernels_ms": attention,
        "top_kernels_ms": {k[:90]: v for k, v in ranked.items()},
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
    rows: dict[str, list[dict[str, float]]] = {a: [] for a in works}
    with gc_paused():
        for i in range(steps):
            for name in list(works)[:: 1 if i % 2 == 0 else -1]:
                rows[name].append(timed_step(works[name]))
    inductor_counters = dict(torch._dynamo.utils.counters.get("inductor", {}))  # cudagraph_skips among them
    for work in works.values():
        work.close()
    column = lambda a, what: [r[what] for r in rows[a]]
    times = {a: column(a, "wall_ms") for a in works}
    result = {
        a: {**summarize_ms(t), "ms": t, "host_ms": column(a, "host_ms"), "device_ms": column(a, "device_ms")}
        for a, t in times.items()
    }
    result["inductor_counters"] = inductor_counters
    ours, ref = times["flash_triton"], times["sdpa"]
    result["ratio_of_means"] = statistics.fmean(ours) / statistics.fmean(ref)
    result["ratio_of_medians"] = statistics.median(ours) / statistics.median(ref)
    result["median_pair_ratio"] = statistics.median(o / r for o, r in zip(ours, ref, strict=True))
    return result


ALLOCATOR_COUNTERS = ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")


def slow_step_ops(prof, n_top: int = 8) -> dict:
    """The slowest and the median profiled step (``record_function("step N")``): their top-level CPU ops by
    duration, to tell a host stall inside our Python from one inside torch (allocator, graph launch)."""
    events = prof.events()
    steps = sorted((e for e in events if e.name.startswith("step ")), key=lambda e: e.time_range.elapsed_us())
    if not steps:
        return {}

    def top(step) -> list:
        r = step.time_range
        inside = [e for e in events if e is not step and r.start <= e.time_range.start < r.end]
        inside.sort(key=lambda e: -e.time_range.elapsed_us())
        return [(e.name[:80], round(e.time_range.elapsed_us() / 1e3, 2)) for e in inside[:n_top]]

    slow, median = steps[-1], steps[len(steps) // 2]
    return {
        "slowest_step_ms": slow.time_range.elapsed_us() / 1e3,
        "slowest_top_ops_ms": top(slow),
        "median_step_ms": median.time_range.elapsed_us() / 1e3,
        "median_top_ops_ms": top(median),
    }


def warm_compiled(size: str, ctx: int, attention: str, cudagraphs: bool = True) -> Workload:
    """The compiled model (``cudagraphs``: CUDA-graphed, as the bench rows) after 5 warm-up steps (compile,
    tuning, the graphs' warm-up and recording runs)."""
    work = Workload(Case(size, ctx, "fwd_bwd", "bf16", True, attention, cudagraphs=cudagraphs), "cuda")
    for _ in range(5):
        work.step()
    torch.cuda.synchronize()
    return work


def cpu_self_per_step(prof, steps: int, n_top: int) -> list:
    """The ``n_top`` ops by CPU self time per step of a profiled window of ``steps`` steps: (name, ms, calls)."""
    ranked = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:n_top]
    return [(e.key[:90], round(e.self_cpu_time_total / 1e3 / steps, 3), e.count // steps) for e in ranked]


def stalls(size: str, ctx: int, steps: int, attentions: tuple[str, ...] = ("sdpa", "flash_triton")) -> dict:
    """One compiled, CUDA-graphed model at a time (as the bench rows): per step wall, host (enqueue) and
    device (events) ms and the caching allocator's device allocs/frees/retries/syncs in that step; then a
    profiled window and the ops of its slowest step."""
    result = {}
    for attention in attentions:
        work = warm_compiled(size, ctx, attention)
        rows = []
        with gc_paused():
            for _ in range(steps):
                before = torch.cuda.memory_stats()
                row = timed_step(work)
                after = torch.cuda.memory_stats()
                rows.append({**row, **{c: after.get(c, 0) - before.get(c, 0) for c in ALLOCATOR_COUNTERS}})
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for i in range(steps):
                    with torch.profiler.record_function(f"step {i}"):
                        work.step()
                        torch.cuda.synchronize()
        kernels_ms = profile_steps(work)
        work.close()
        walls = [r["wall_ms"] for r in rows]
        result[attention] = {
            **summarize_ms(walls),
            "steps": rows,
            "profiled": slow_step_ops(prof),
            "cpu_self_ms_per_step": cpu_self_per_step(prof, steps, 25),
            **kernels_ms,
        }
    result["tuning"] = kernels.tuning_report()
    return result


def _saved_by_compiled_graphs(loss: torch.Tensor) -> list[int]:
    """How many tensors each compiled graph's backward node holds (the forward graph's outputs kept for
    backward: under CUDA graphs, every one is rebuilt in Python on each replay)."""
    counts, seen, todo = [], set(), [loss.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if "CompiledFunction" in node.name():
            counts.append(len(node.saved_tensors))
        todo.extend(fn for fn, _ in node.next_functions)
    return counts


def python_self_per_step(work: Workload, steps: int, n_top: int) -> list:
    """cProfile over ``steps`` steps: the ``n_top`` Python functions by own time per step, (file:line name,
    ms, calls). Inflated by cProfile, but it names the Python a host-bound step runs (inductor's wrappers,
    launchers, the autograd Function), which torch.profiler's op view does not."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        work.step()
    prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # {(file, line, name): (prim calls, calls, tottime, cumtime, callers)}
    ranked = sorted(stats.items(), key=lambda kv: -kv[1][2])[:n_top]
    return [
        (f"{Path(f).name}:{line} {name}"[:90], round(tt * 1e3 / steps, 3), calls // steps)
        for (f, line, name), (_, calls, tt, _, _) in ranked
    ]


def host_split(work: Workload, steps: int) -> dict:
    """Host (enqueue) ms of the forward+loss and of the backward per step, the tensors saved by the compiled
    graphs, the CPU self time per op and per Python function over ``steps`` steps: where the host time of a
    step goes."""
    fwd, bwd = [], []
    for _ in range(steps):
        torch.compiler.cudagraph_mark_step_begin()
        work.clear_grads()
        t0 = time.perf_counter()
        loss = work.loss()
        t1 = time.perf_counter()
        saved = _saved_by_compiled_graphs(loss)
        t2 = time.perf_counter()
        loss.backward()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        fwd.append((t1 - t0) * 1e3)
        bwd.append((t3 - t2) * 1e3)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            work.step()
            torch.cuda.synchronize()
    return {
        "forward_host_ms": statistics.median(fwd),
        "backward_host_ms": statistics.median(bwd),
        "saved_tensors": saved,
        "cpu_self_ms_per_step": cpu_self_per_step(prof, steps, 30),
        "python_self_ms_per_step": python_self_per_step(work, steps, 30),
    }


def kernel_table(size: str, ctx: int, steps: int, variants: tuple[str, ...], cudagraphs: bool = True) -> dict:
    """One compiled model per variant (``cudagraphs``: CUDA-graphed, else inductor's own launches): per-step
    device ms, then a profiled window's GPU ms per kernel (every kernel), to see what each attention adds or
    saves around itself (copies, RoPE, casts) besides its own kernels. Variants: "sdpa", "flash_triton"
    (graphed plans under CUDA graphs, else traced launches), "flash_triton/opaque" (the opaque ops with eager
    plans, as before session 14), "flash_triton/traced" (inductor launches the block-pointer kernels, as the
    compiled model without CUDA graphs does)."""
    from cs336_systems.attention import flash_triton

    result = {}
    for variant in variants:
        attention, _, how = variant.partition("/")
        saved = flash_triton.TRACED_MAX_WORK, flash_triton._cuda_graphed
        if how == "opaque":
            flash_triton.TRACED_MAX_WORK = 0
        elif how == "traced":
            flash_triton._cuda_graphed = lambda: False
        try:
            work = warm_compiled(size, ctx, attention, cudagraphs)
            with gc_paused():
                rows = [timed_step(work) for _ in range(steps)]
            profiled = profile_steps(work, steps=5, top=60)
            profiled["host"] = host_split(work, steps)
            work.close()
        finally:
            flash_triton.TRACED_MAX_WORK, flash_triton._cuda_graphed = saved
        device = [r["device_ms"] for r in rows]
        result[variant] = {**summarize_ms(device), "steps": rows, **profiled}
    result["tuning"] = kernels.tuning_report()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--size", default="xl")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument(
        "--modes", help="inductor,cudagraphs (the default); --kernels takes one (default cudagraphs)"
    )
    ap.add_argument("--paired", help="sizes, e.g. small,xl: compiled sdpa and flash_triton, steps alternated")
    ap.add_argument("--cudagraphs", action="store_true", help="--paired with CUDA graphs (reduce-overhead)")
    ap.add_argument(
        "--stalls", help="a size: per-step wall/host/device ms and allocator counts, CUDA-graphed"
    )
    ap.add_argument("--attentions", default="sdpa,flash_triton", help="--stalls: which models, in this order")
    ap.add_argument("--kernels", help="a size: every kernel's GPU ms per CUDA-graphed step, per --attentions "
                    "variant (flash_triton/opaque: the custom ops at every size)")  # fmt: skip
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.kernels:
        variants = tuple(args.attentions.split(","))
        modes = (args.modes or "cudagraphs").split(",")
        if len(modes) != 1 or modes[0] not in ("inductor", "cudagraphs"):
            ap.error(f"--kernels takes one of --modes inductor or cudagraphs, got {args.modes!r}")
        cudagraphs = modes[0] == "cudagraphs"
        result = {
            "device": torch.cuda.get_device_name(),
            "ctx": args.ctx,
            "size": args.kernels,
            "mode": modes[0],
        }
        result.update(kernel_table(args.kernels, args.ctx, args.steps, variants, cudagraphs))
        (args.out / f"model_attention_kernels_{args.kernels}_{modes[0]}.json").write_text(
            json.dumps(result, indent=1, default=str)
        )
        for v in variants:
            r = result[v]
            h = r["host"]
            print(f"{v}: device {r['mean_ms']:.2f} ± {r['std_ms']:.2f} ({r['median_ms']:.2f}) ms, GPU busy "
                  f"{r['gpu_busy_ms']:.2f}, attention {r['attention_ms']:.3f}; host fwd {h['forward_host_ms']:.2f}"
                  f" bwd {h['backward_host_ms']:.2f} ms, saved tensors {h['saved_tensors']}")  # fmt: skip
            for row in h["cpu_self_ms_per_step"]:
                print("   ", row)
            print("  Python self ms per step (cProfile):")
            for row in h["python_self_ms_per_step"]:
                print("   ", row)
        names = dict.fromkeys(k for v in variants for k in result[v]["top_kernels_ms"])
        print("kernel | " + " | ".join(variants))
        for k in names:
            print(
                k[:70] + " | " + " | ".join(f"{result[v]['top_kernels_ms'].get(k, 0):.3f}" for v in variants)
            )
        return
    if args.stalls:
        result = {"device": torch.cuda.get_device_name(), "ctx": args.ctx, "size": args.stalls}
        result.update(stalls(args.stalls, args.ctx, args.steps, tuple(args.attentions.split(","))))
        (args.out / "model_attention_stalls.json").write_text(json.dumps(result, indent=1, default=str))
        for attention in args.attentions.split(","):
            r = result[attention]
            print(f"{attention}: {r['mean_ms']:.2f} ± {r['std_ms']:.2f} ({r['median_ms']:.2f}) ms")
            for i, row in enumerate(r["steps"]):
                print(f"  step {i}: " + " ".join(f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}"
                                             for k, v in row.items()))  # fmt: skip
            print("  profiled:", json.dumps(r["profiled"]))
            print(f"  GPU busy {r['gpu_busy_ms']:.2f} ms, attention {r['attention_ms']:.3f} ms:",
                  json.dumps({k[:60]: round(v, 4) for k, v in r["attention_kernels_ms"].items()}))  # fmt: skip
        return
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
    for mode in (args.modes or "inductor,cudagraphs").split(","):
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
