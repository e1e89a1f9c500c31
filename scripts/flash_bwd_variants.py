"""Variants of the FlashAttention backward kernels at d = 128, long causal sequences (issues 14, 17).

    python scripts/flash_bwd_variants.py --out DIR [--budget-s 300]

1. At (1, 32, 32768, 128, causal), bf16: the backward launcher (dQ pass + dK/dV pass) with one kernel's
   tiles / warps / stages varied at a time, the other pinned to its previous 32k choice. Each variant's
   dQ, dK, dV are checked against the pinned baseline's before it is timed.
2. Per shape: ours (tuned over the short lists), ours tuned without the candidates issue 17 added
   ("ours_before", d = 128), ours with the best variant tiles added if not listed, SDPA cuDNN and flash;
   backward-only and forward+backward do_bench medians (ms).

docs/results/issue14/h100-bwd-d128.json comes from this script at commit 60cda7b: it also had loop-hint
variants (``tl.range`` num_stages 4, unroll 2, via rebound kernel globals; they did not build on the
device and were dropped), and there "ours" tuned the lists with two since-dropped candidates (it
failed at 32k), "ours_before" the lists before issue 17 and "ours_extended" those plus the winners,
which are the lists now.

Writes ``bwd_variants.json`` under --out after every measurement (a timeout still leaves the rows).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.testing import do_bench

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash_attention as kernels

C = kernels.TileConfig
# The 32k d128 choices before issue 17 (docs/results/issue14/h100-flash-check-call2.json).
BASE = {"dq": C(128, 32, 4, 3, True), "dkdv": C(32, 64, 4, 3, True)}
# (kernel, config), most promising first; the two kernels' lists are interleaved so that a short budget
# still covers both.
_VARIANTS: list[tuple[str, C]] = [
    ("dkdv", BASE["dkdv"]),
    ("dkdv", C(32, 128, 8, 2, True)),
    ("dkdv", C(32, 128, 8, 3, True)),
    ("dkdv", C(16, 128, 8, 3, True)),
    ("dkdv", C(16, 128, 8, 2, True)),
    ("dkdv", C(64, 128, 8, 2, True)),
    ("dkdv", C(32, 64, 4, 2, True)),
    ("dkdv", C(32, 64, 4, 4, True)),
    ("dkdv", C(16, 64, 4, 3, True)),
    ("dkdv", C(64, 64, 4, 3, True)),
    ("dkdv", C(64, 128, 8, 3, True)),
    ("dq", BASE["dq"]),
    ("dq", C(128, 32, 8, 2, True)),
    ("dq", C(128, 32, 8, 3, True)),
    ("dq", C(128, 64, 8, 2, True)),
    ("dq", C(128, 64, 8, 3, True)),
    ("dq", C(128, 32, 4, 2, True)),
    ("dq", C(128, 32, 4, 4, True)),
    ("dq", C(64, 64, 4, 3, True)),
    ("dq", C(64, 32, 4, 4, True)),
    ("dq", C(128, 16, 4, 3, True)),
    ("dq", C(256, 32, 8, 2, True)),
]
_BY_KERNEL = [[v for v in _VARIANTS if v[0] == kernel] for kernel in ("dkdv", "dq")]
VARIANTS = [v for pair in itertools.zip_longest(*_BY_KERNEL) for v in pair if v is not None]
# Candidates issue 17 added to the bf16 d > 64 short lists ("ours_before" tunes without them).
ADDED = {"dkdv": [C(64, 128, 8, 3, True)], "dq": [C(128, 64, 8, 3, True)]}
SHAPES = [(1, 32, 32768, 128), (2, 32, 4096, 128), (1, 16, 16384, 64), (8, 12, 2048, 64)]
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}


@contextlib.contextmanager
def using(kernel: str, config: C):
    """``kernel`` pinned to ``config``."""
    kernels.force_config(kernel, config)
    try:
        yield
    finally:
        kernels.force_config(kernel, None)


def bench(fn) -> float:
    return do_bench(fn, warmup=50, rep=300, return_mode="median")


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm()).item()


def make(shape: tuple[int, int, int, int], seed: int = 0):
    b, h, n, d = shape
    g = torch.Generator("cuda").manual_seed(seed)
    mk = lambda: torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return mk(), mk(), mk(), mk()


def phase_variants(result: dict, save, deadline: float) -> None:
    q, k, v, do = make(SHAPES[0])
    o, lse = kernels.flash_forward(q, k, v, True)
    for name, cfg in BASE.items():
        kernels.force_config(name, cfg)
    ref = kernels.flash_backward(q, k, v, o, do, lse, True)
    for kernel, cfg in VARIANTS:
        row = {"kernel": kernel, "config": str(cfg)}
        result["variants"].append(row)
        if time.perf_counter() > deadline:
            row["skipped"] = "budget"
            continue
        for name, base in BASE.items():
            kernels.force_config(name, base)
        try:
            with using(kernel, cfg):
                t0 = time.perf_counter()
                out = kernels.flash_backward(q, k, v, o, do, lse, True)
                torch.cuda.synchronize()
                row["first_call_s"] = round(time.perf_counter() - t0, 2)
                row["rel_err_vs_base"] = [rel(x, r) for x, r in zip(out, ref, strict=True)]
                row["bwd_ms"] = bench(lambda: kernels.flash_backward(q, k, v, o, do, lse, True))
        except Exception as exc:  # a variant that does not build is a result
            row["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"
        print(row, flush=True)
        save()
    for name in BASE:
        kernels.force_config(name, None)


def best(result: dict, kernel: str) -> dict | None:
    ok = [
        r
        for r in result["variants"]
        if r["kernel"] == kernel and "bwd_ms" in r and max(r["rel_err_vs_base"]) < 1e-2
    ]
    return min(ok, key=lambda r: r["bwd_ms"]) if ok else None


def time_ours(q, k, v, do) -> dict:
    o, lse = kernels.flash_forward(q, k, v, True)
    kernels.flash_backward(q, k, v, o, do, lse, True)  # tunes
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def fwd_bwd():
        FlashAttentionTriton.apply(qg, kg, vg, True).backward(do)

    fwd_bwd()
    return {
        "bwd_ms": bench(lambda: kernels.flash_backward(q, k, v, o, do, lse, True)),
        "fwd_bwd_ms": bench(fwd_bwd),
        "configs": kernels.chosen_configs(q.shape[0] * q.shape[1], q.shape[2], q.shape[2], q.shape[3], True,
                                          q.dtype),
    }  # fmt: skip


def time_sdpa(backend: str, q, k, v, do) -> dict:
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(BACKENDS[backend]):
        out = F.scaled_dot_product_attention(qg, kg, vg, is_causal=True)
        bwd = lambda: torch.autograd.grad(out, (qg, kg, vg), do, retain_graph=True)

        def fwd_bwd():
            F.scaled_dot_product_attention(qg, kg, vg, is_causal=True).backward(do)

        return {"bwd_ms": bench(bwd), "fwd_bwd_ms": bench(fwd_bwd)}


@contextlib.contextmanager
def extended_lists(extra: dict, drop: dict | None = None):
    """The bf16 d > 64 short lists with ``extra`` configs appended and ``drop`` ones removed (tuning
    starts afresh)."""
    original = kernels._candidates
    drop = drop or {}

    def patched(kernel: str, d: int, dtype: torch.dtype):
        listed = original(kernel, d, dtype)
        if d > 64 and dtype == torch.bfloat16:
            listed = [c for c in listed if c not in drop.get(kernel, ())]
            listed += [extra[kernel]] if kernel in extra else []
        return listed

    kernels._candidates = patched
    kernels.candidate_configs.cache_clear()
    kernels.clear_tuning_cache()
    try:
        yield
    finally:
        kernels._candidates = original
        kernels.candidate_configs.cache_clear()
        kernels.clear_tuning_cache()


def phase_shapes(result: dict, save) -> None:
    winners = {kernel: best(result, kernel) for kernel in BASE}
    result["winners"] = winners
    listed = {kernel: kernels.candidate_configs(kernel, 128, torch.bfloat16) for kernel in BASE}
    extra = {}
    for kernel, w in winners.items():
        cfg = next(c for kern, c in VARIANTS if kern == kernel and str(c) == w["config"]) if w else None
        if cfg is not None and cfg not in listed[kernel]:
            extra[kernel] = cfg
    result["extra_candidates"] = {k: str(c) for k, c in extra.items()}
    for shape in SHAPES:
        q, k, v, do = make(shape, seed=1)
        row: dict = {"shape": [*shape[:3], shape[2], shape[3], True]}
        result["shapes"].append(row)
        runs = [("ours", time_ours, ()), ("cudnn", time_sdpa, ("cudnn",)), ("flash", time_sdpa, ("flash",))]
        for name, fn, extra_args in runs:
            try:
                row[name] = fn(*extra_args, q, k, v, do)
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {str(exc).strip().splitlines()[-1][:300]}"}
            print(shape, name, row[name], flush=True)
            save()
        if shape[3] > 64:  # the lists before this change (issue 17), tuned again
            with extended_lists({}, ADDED):
                try:
                    row["ours_before"] = time_ours(q, k, v, do)
                except Exception as exc:
                    row["ours_before"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(shape, "ours_before", row["ours_before"], flush=True)
            save()
        if extra and shape[3] > 64:  # the short lists plus the winning tiles, tuned again
            with extended_lists(extra):
                try:
                    row["ours_extended"] = {
                        "added": {name: str(c) for name, c in extra.items()},
                        **time_ours(q, k, v, do),
                    }
                except Exception as exc:
                    row["ours_extended"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            print(shape, "ours_extended", row["ours_extended"], flush=True)
            save()
        del q, k, v, do
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--budget-s", type=float, default=300.0, help="stop starting variants after this")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "base": {k: str(v) for k, v in BASE.items()},
        "variants": [],
        "shapes": [],
    }

    def save() -> None:
        (args.out / "bwd_variants.json").write_text(json.dumps(result, indent=1))

    start = time.perf_counter()
    phase_variants(result, save, start + args.budget_s)
    result["variants_s"] = round(time.perf_counter() - start, 1)
    phase_shapes(result, save)
    result["report"] = kernels.tuning_report()
    result["total_s"] = round(time.perf_counter() - start, 1)
    save()


if __name__ == "__main__":
    main()
