"""GPU check-and-time script for the FlashAttention-2 kernels (D12), one command per device call:

    PYTHONPATH=src python3 scripts/flash_tune.py [--out DIR] [--quick]

1. Correctness of the leaderboard case (batch 1 x 16 heads folded into batch, seq 16384, d 64, bf16,
   causal) under torch.compile(apply), against torch SDPA on float32 copies.
2. do_bench medians: ours (forward alone; forward+backward through torch.compile(apply), the leaderboard
   harness) beside torch SDPA's flash, cuDNN and mem-efficient backends on (1, 16, seq, d), for the
   leaderboard case and for fp32 / d = 128 at seq 16384.
3. The tuning choice and every candidate's time per kernel and key (what autotuning measured).
4. The two ceilings: dense bf16 matmul rate, and FLOP counts of each case.
Prints a short table last; writes everything as JSON to DIR/flash_tune.json (DIR defaults to $OUT or .).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash_attention as kernels

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
SDPA_BACKENDS = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}


def attention_flops(heads: int, seq: int, d: int, causal: bool) -> tuple[float, float]:
    """Forward and backward matmul FLOPs (2 matmuls forward, 5 backward; causal halves both)."""
    fwd = 4 * heads * seq * seq * d / (2 if causal else 1)
    return fwd, 2.5 * fwd


def bench_ms(fn, warmup: int, rep: int) -> float:
    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def matmul_tflops(dtype: torch.dtype = torch.bfloat16, n: int = 8192) -> float:
    a, b = (torch.randn(n, n, device="cuda", dtype=dtype) for _ in range(2))
    ms = bench_ms(lambda: a @ b, 100, 500)
    return 2 * n**3 / ms / 1e9


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def make_qkv(heads: int, seq: int, d: int, dtype: torch.dtype):
    # Leaderboard layout: (3, heads, seq, d) drawn at once, heads folded into batch for our function.
    q, k, v = torch.randn(3, heads, seq, d, device="cuda", dtype=dtype)
    return [t.requires_grad_() for t in (q, k, v)]


def check_leaderboard_case(heads: int, seq: int, d: int) -> dict[str, float]:
    q, k, v = make_qkv(heads, seq, d, torch.bfloat16)
    do = torch.randn_like(q)
    flash = torch.compile(FlashAttentionTriton.apply)
    o = flash(q, k, v, True)
    (o * do).sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        o_ref = F.scaled_dot_product_attention(q32[None], k32[None], v32[None], is_causal=True)[0]
    o_ref.backward(do.float())
    errors = {"O": rel_err(o, o_ref)}
    errors.update(
        {f"d{n}": rel_err(x.grad, r.grad) for n, x, r in (("Q", q, q32), ("K", k, k32), ("V", v, v32))}
    )
    return errors


def make_fns(impl: str, q, k, v, causal: bool):
    """(forward, forward+backward) callables of one implementation on (heads, seq, d) tensors."""
    if impl == "ours":
        flash = torch.compile(FlashAttentionTriton.apply)  # the leaderboard harness
        return (lambda: FlashAttentionTriton.apply(q, k, v, causal)), (
            lambda: flash(q, k, v, causal).sum().backward()
        )
    q4, k4, v4 = (t.detach()[None].requires_grad_() for t in (q, k, v))  # SDPA layout (1, heads, seq, d)
    backend = SDPA_BACKENDS[impl]

    def fwd():
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal)

    return fwd, lambda: fwd().sum().backward()


def time_case(
    heads: int, seq: int, d: int, dtype_name: str, causal: bool, impls: list[str], warmup: int, rep: int
) -> list[dict]:
    fwd_flops, bwd_flops = attention_flops(heads, seq, d, causal)
    rows = []
    for impl in impls:
        fwd_fn, step_fn = make_fns(impl, *make_qkv(heads, seq, d, DTYPES[dtype_name]), causal)
        row = {"impl": impl, "heads": heads, "seq": seq, "d": d, "dtype": dtype_name, "causal": causal}
        try:
            with torch.no_grad():
                row["fwd_ms"] = bench_ms(fwd_fn, warmup, rep)
            row["fwd_bwd_ms"] = bench_ms(step_fn, warmup, rep)
            row["bwd_ms"] = row["fwd_bwd_ms"] - row["fwd_ms"]
            row["fwd_tflops"] = fwd_flops / row["fwd_ms"] / 1e9
            row["fwd_bwd_tflops"] = (fwd_flops + bwd_flops) / row["fwd_bwd_ms"] / 1e9
        except RuntimeError as exc:  # a backend that does not support the case (e.g. flash with fp32)
            row["error"] = str(exc).splitlines()[0][:80]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del fwd_fn, step_fn
        torch.cuda.empty_cache()
    return rows


def time_components(heads: int, seq: int, d: int, warmup: int, rep: int) -> dict[str, float]:
    """The launchers alone (tuned kernels and their allocations, no autograd / compile / sum / grad
    accumulation): what the harness adds on top is the difference."""
    q, k, v = (t.detach() for t in make_qkv(heads, seq, d, torch.bfloat16))
    o, lse = kernels.flash_forward(q, k, v, True)
    do = torch.randn_like(o)
    return {
        "fwd_launcher": bench_ms(lambda: kernels.flash_forward(q, k, v, True), warmup, rep),
        "bwd_launcher": bench_ms(lambda: kernels.flash_backward(q, k, v, o, do, lse, True), warmup, rep),
    }


def print_table(rows: list[dict]) -> None:
    from tabulate import tabulate

    table = []
    for r in rows:
        case = f"h{r['heads']}-s{r['seq']}-d{r['d']}-{r['dtype']}{'-causal' if r['causal'] else ''}"
        if "error" in r:
            table.append([case, r["impl"], "n/a", "n/a", "n/a", "", r["error"]])
            continue
        ours = next(
            (
                o
                for o in rows
                if o["impl"] == "ours"
                and o["seq"] == r["seq"]
                and o["d"] == r["d"]
                and o["dtype"] == r["dtype"]
                and "error" not in o
            ),
            None,
        )
        ratio = f"{ours['fwd_bwd_ms'] / r['fwd_bwd_ms']:.2f}" if ours and r is not ours else ""
        table.append(
            [
                case,
                r["impl"],
                f"{r['fwd_ms']:.3f}",
                f"{r['bwd_ms']:.3f}",
                f"{r['fwd_bwd_ms']:.3f}",
                f"{r['fwd_bwd_tflops']:.0f}",
                ratio,
            ]
        )
    print(tabulate(table, headers=["case", "impl", "fwd ms", "bwd ms", "fwd+bwd ms", "TFLOP/s", "ours/this"]))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--quick", action="store_true", help="leaderboard case only, shorter timing")
    parser.add_argument(
        "--wide", action="store_true", help="tune over the wide candidate grid (slow; implies --quick)"
    )
    args = parser.parse_args()
    if args.wide:
        kernels.CANDIDATE_SET = "wide"
        args.quick = True
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    warmup, rep = (100, 300) if args.quick else (200, 1000)
    info = {
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "bf16_matmul_tflops": matmul_tflops(),
    }
    print(json.dumps(info), flush=True)
    t0 = time.time()
    info["leaderboard_errors"] = check_leaderboard_case(16, 16384, 64)
    info["check_s"] = time.time() - t0  # includes tuning and compiling
    print(
        json.dumps({"leaderboard_errors": info["leaderboard_errors"], "check_s": info["check_s"]}), flush=True
    )

    all_sdpa = ["ours", "sdpa_flash", "sdpa_cudnn", "sdpa_efficient"]
    rows = time_case(16, 16384, 64, "bf16", True, all_sdpa, warmup, rep)
    info["components_ms"] = time_components(16, 16384, 64, warmup, rep)
    print(json.dumps({"components_ms": info["components_ms"]}), flush=True)
    if not args.quick:
        for dtype_name, d in (("fp32", 64), ("bf16", 128), ("fp32", 128)):
            impls = ["ours", "sdpa_efficient"] + (
                ["sdpa_flash", "sdpa_cudnn"] if dtype_name == "bf16" else []
            )
            rows += time_case(16, 16384, d, dtype_name, True, impls, warmup // 2, rep // 2)
    info["rows"] = rows
    info["tuning"] = kernels.tuning_report()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "flash_tune.json"), "w") as f:
        json.dump(info, f, indent=1)

    print("\n# tuning (chosen, then candidate medians in ms)")
    for key, rep_ in sorted(info["tuning"]["keys"].items()):
        timings = ", ".join(f"{c}={t:.3f}" for c, t in sorted(rep_["timings_ms"].items(), key=lambda x: x[1]))
        print(f"{key}: {rep_['chosen']}  [{timings}]")
    for what, err in info["tuning"]["build_errors"].items():
        print(f"build error {what}: {err}")
    print(
        f"\n# {info['gpu']}, torch {info['torch']}, triton {info['triton']}, "
        f"bf16 matmul {info['bf16_matmul_tflops']:.0f} TFLOP/s; leaderboard errors "
        + ", ".join(f"{k}={v:.1e}" for k, v in info["leaderboard_errors"].items())
    )
    print_table(rows)
    print("launchers alone (ms): " + ", ".join(f"{k}={v:.3f}" for k, v in info["components_ms"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
