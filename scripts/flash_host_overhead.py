"""Host cost of one eager attention call at the xl model's shape (issue 14): where the microseconds go.

    python scripts/flash_host_overhead.py [--out DIR] [--calls 200] [--rounds 7] [--layout contiguous] [--profile]

At (4, 25, 512, 64), causal, bf16, in the model's layout (v a permuted view of the fused QKV
projection), forward+backward without synchronizing: host microseconds per call (min and median over
interleaved rounds; SDPA's backend pinned once per round, not per call) of SDPA's flash and cuDNN
backends, ours, and two floors that launch nothing: a
Python autograd.Function that makes the same allocations as ours ("null, our allocations") and one that
makes the fewest ("null"). Also ours through the C++ ``_FunctionBase.apply`` without the Python
``Function.apply`` wrapper, and do_bench device time of the three. The fwd+bwd of this shape is
host-bound on the lent GPUs: this is the number that decides it. ``--layout contiguous``: (batch, heads,
seq, d) contiguous inputs, as the bench's attention shapes group has them. ``--profile``: the top CPU
ops (self time) of 50 fwd+bwd calls of ours and of SDPA flash, from torch.profiler. Writes
``host_overhead.json``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash_attention as kernels


class NullMinimal(torch.autograd.Function):
    """The floor of any Python autograd.Function: one output, three gradients, nothing launched."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        ctx.save_for_backward(q, k, v)
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        q, k, v = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


class NullOurAllocations(torch.autograd.Function):
    """Our autograd function's allocations and saved tensors, nothing launched."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal):
        o = kernels.new_output(q)
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(lse, q, k, v, o)
        return o

    @staticmethod
    def backward(ctx, do):
        lse, q, k, v, _ = ctx.saved_tensors
        torch.empty_like(lse)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def model_inputs(b=4, h=25, n=512, d=64, layout="model"):
    if layout == "contiguous":
        q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), do
    qkv = torch.randn(b, n, 3, h, d, device="cuda", dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    q, k = qkv[0].contiguous().requires_grad_(), qkv[1].contiguous().requires_grad_()
    v = qkv[2].detach().requires_grad_()
    do = torch.randn(b, n, h, d, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    return q, k, v, do


def sdpa(q, k, v, causal):
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


BACKENDS = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION}


def pinned(name: str):
    """The SDPA backend of ``name`` pinned (entered once around many calls: its cost is not the call's)."""
    backend = next((b for n, b in BACKENDS.items() if name.startswith(n)), None)
    return sdpa_kernel(backend) if backend is not None else contextlib.nullcontext()


def profile_top(step, calls: int = 50, top: int = 15) -> list[tuple[str, float, int]]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return [(e.key, e.self_cpu_time_total / calls, e.count // calls) for e in rows]


def host_us(step, calls: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        step()
    us = (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    return us


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", type=Path)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--heap-objects", type=int, default=2_000_000)
    ap.add_argument("--layout", choices=("model", "contiguous"), default="model")
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    q, k, v, do = model_inputs(layout=args.layout)
    raw_apply = torch._C._FunctionBase.__dict__["apply"].__get__(None, FlashAttentionTriton)
    fns = {
        "sdpa_flash": sdpa,
        "sdpa_cudnn": sdpa,
        "ours": FlashAttentionTriton.apply,
        "ours_raw_apply": raw_apply,
        "null_our_allocations": NullOurAllocations.apply,
        "null": NullMinimal.apply,
    }

    def grads_reset():
        q.grad = k.grad = v.grad = None

    steps = {}
    for name, fn in fns.items():
        steps[f"{name} fwd+bwd"] = lambda fn=fn: (fn(q, k, v, True).backward(do), grads_reset())
        steps[f"{name} fwd"] = lambda fn=fn: fn(q, k, v, True)
    for name, step in steps.items():  # warm-up: compiles, tunes, plans
        with pinned(name):
            for _ in range(20):
                step()
    samples: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            with pinned(name):
                samples[name].append(host_us(step, args.calls))
    profiles = {}
    if args.profile:
        for name in ("ours fwd+bwd", "sdpa_flash fwd+bwd"):
            with pinned(name):
                profiles[name] = profile_top(steps[name])
    # A process that holds as many Python objects as a pytest run of the benches: does the garbage
    # collector's pass land in the timings, for us (more Python objects per call) or SDPA?
    heap = [[i] for i in range(args.heap_objects)]
    for name in ("ours fwd+bwd", "sdpa_flash fwd+bwd"):
        for gc_on in (True, False):
            gc.collect()
            (gc.enable if gc_on else gc.disable)()
            key = f"{name}, {len(heap)} objects, gc {'on' if gc_on else 'off'}"
            with pinned(name):
                samples[key] = [host_us(steps[name], args.calls) for _ in range(args.rounds)]
                dev = do_bench(steps[name])
            samples[key + " do_bench_us"] = [dev * 1e3]
    gc.enable()
    del heap
    device = {}
    for name in ("sdpa_flash", "sdpa_cudnn", "ours"):
        with pinned(name):
            step = lambda fn=fns[name]: fn(q, k, v, True).backward(do)
            device[name] = do_bench(step, grad_to_none=[q, k, v])
    result = {
        "device": torch.cuda.get_device_name(),
        "host_us": {n: {"min": min(s), "median": statistics.median(s)} for n, s in samples.items()},
        "do_bench_fwd_bwd_ms": device,
        "layout": args.layout,
        "profile_us_per_call": profiles,
    }
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "host_overhead.json").write_text(json.dumps(result, indent=1))
    print(f"host us per call at (4, 25, 512, 64) causal bf16, {result['device']} (min / median of rounds)")
    for name, s in result["host_us"].items():
        print(f"{name:60s} {s['min']:7.1f} {s['median']:7.1f}")
    print("do_bench fwd+bwd ms:", {n: round(ms, 4) for n, ms in device.items()})
    for name, rows in profiles.items():
        print(f"\n{name}: top CPU ops, self us per call (count per call)")
        for key, us, count in rows:
            print(f"  {key[:70]:70s} {us:7.1f} ({count})")


if __name__ == "__main__":
    main()
