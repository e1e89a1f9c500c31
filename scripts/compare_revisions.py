"""Time the FlashAttention of an earlier revision and of this tree side by side, in one process: how a
refactor proves it kept every win. Both versions tune their own configs (recorded per case); each case's
forward+backward is timed in interleaved rounds (order alternating; the ratio is the median of per-round
ratios, so drift cancels), eagerly (``do_bench``) and replayed from a CUDA graph. Where the two chose
different configs, the new tree is timed again pinned to the old's ("pinned"): the code's cost apart from
near-tie tuning. Cases: the attention shapes group (bf16, 4-D) and the leaderboard case (compiled ``apply``).

    python scripts/compare_revisions.py export b5e7783 .ab/old      # here: the old package as cs336_old
    PYTHONPATH=src:.ab/old python scripts/compare_revisions.py run --out ab.json   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import tarfile
import tempfile
import time
from pathlib import Path

OLD = "cs336_old"


def export(rev: str, dest: Path) -> None:
    """``src/cs336_systems`` at ``rev`` as the package ``cs336_old`` under ``dest`` (imports and custom-op
    namespaces renamed, so both versions load and register their ops in one process)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", archive, rev, "src/cs336_systems"], check=True)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        dest.mkdir(parents=True, exist_ok=True)
        for path in (Path(tmp) / "src" / "cs336_systems").rglob("*.py"):
            out = dest / OLD / path.relative_to(Path(tmp) / "src" / "cs336_systems")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(re.sub(r"\bcs336_systems\b", OLD, path.read_text()))


def _ms_rounds(steps: dict, timer, rounds: int) -> dict[str, list[float]]:
    """``timer(step)`` of every step per round, the order alternating per round."""
    out: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(timer(steps[name]))
    return out


def _summary(ms: dict[str, list[float]]) -> dict[str, float]:
    ratios = [n / o for n, o in zip(ms["new"], ms["old"], strict=True)]
    return {"old_ms": statistics.median(ms["old"]), "new_ms": statistics.median(ms["new"]),
            "ratio": statistics.median(ratios)}  # fmt: skip


def _pin_new(case: tuple, configs: dict[str, str]) -> bool:
    """Make the new tree's eager choice for ``case`` the old's ``configs`` (False: one left the lists)."""
    from cs336_systems.kernels import flash

    for kernel, name in configs.items():
        key, candidates = flash.tune_space(kernel, "eager", case)
        if not (match := [c for c in candidates if str(c) == name]):
            return False
        flash.TUNER.cache[key] = match[0]
    flash.clear_plans()
    return True


def _time_shape(applies: dict, shape: tuple, gen, rounds: int) -> dict:
    """One bf16 4-D case: each version's first call (plans, tuning, compiles) and configs, their outputs'
    and gradients' relative difference, and the interleaved eager and CUDA-graph timings of fwd+bwd."""
    import importlib

    import torch
    import triton.testing as tt

    from cs336_systems.kernels import flash

    b, h, nq, nk, d, causal = shape
    q, k, v, do = (
        torch.randn(b, h, n, d, generator=gen).to("cuda", torch.bfloat16) for n in (nq, nk, nk, nq)
    )
    leaves = [x.requires_grad_() for x in (q, k, v)]
    steps, first_s, outs = {}, {}, {}
    for name, apply in applies.items():
        steps[name] = lambda apply=apply: apply(q, k, v, causal).backward(do)
        start = time.perf_counter()
        o = apply(q, k, v, causal)
        o.backward(do)
        torch.cuda.synchronize()
        first_s[name] = time.perf_counter() - start
        outs[name] = [o.detach().float(), *(x.grad.float() for x in leaves)]
        for x in leaves:
            x.grad = None
    diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(outs["new"], outs["old"], strict=True))
    case = (b * h, nq, nk, d, causal, q.dtype)
    old_configs = importlib.import_module(f"{OLD}.kernels.flash_attention").chosen_configs(*case)
    configs = {"old": old_configs, "new": flash.chosen_configs(case)}
    timer = lambda s: tt.do_bench(s, warmup=5, rep=30, grad_to_none=leaves)
    row = {"shape": shape, "rel_diff": diff, "first_call_s": first_s, "configs": configs,
           "eager": _summary(_ms_rounds(steps, timer, rounds))}  # fmt: skip
    # Fresh leaves for the graphs: the eager steps' AccumulateGrad nodes belong to the legacy stream.
    fresh = [x.detach().clone().requires_grad_() for x in leaves]
    graphed = {
        name: lambda apply=apply: apply(*fresh, causal).backward(do) for name, apply in applies.items()
    }
    gtimer = lambda s: tt.do_bench_cudagraph(s, rep=20, grad_to_none=fresh)
    row["graph"] = _summary(_ms_rounds(graphed, gtimer, 2))
    if configs["old"] != configs["new"] and _pin_new(case, old_configs):
        row["pinned"] = _summary(_ms_rounds(steps, timer, rounds))
    return row


def run(out: Path, rounds: int) -> None:
    import importlib

    import pandas as pd
    import torch
    import triton.testing as tt

    from cs336_systems.harness.attention import ATTENTION_SHAPES, BREADTH_SHAPES

    applies = {
        "old": importlib.import_module(f"{OLD}.attention.flash_triton").FlashAttentionTriton.apply,
        "new": importlib.import_module("cs336_systems.attention.flash_triton").FlashAttentionTriton.apply,
    }
    gen = torch.Generator().manual_seed(0)
    rows = []
    save = lambda: out.write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": rows}, indent=1))
    for shape in (*ATTENTION_SHAPES, *BREADTH_SHAPES):
        rows.append(_time_shape(applies, shape, gen, rounds))
        save()  # a run cut off by its time limit keeps the cases it finished
        print(
            shape, {k: round(rows[-1][k]["ratio"], 3) for k in ("eager", "graph", "pinned") if k in rows[-1]}
        )
        torch.cuda.empty_cache()
    # The leaderboard case, exactly as the handout calls it: 3-D views, a compiled apply.
    q, k, v = torch.randn(3, 16, 16384, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    lb = {}
    for name, apply in applies.items():
        compiled = torch.compile(apply)
        lb[name] = lambda flash=compiled: flash(q, k, v, True).sum().backward()
        lb[name]()  # compiles, tunes
    timer = lambda s: tt.do_bench(s, warmup=200, rep=1000, grad_to_none=[q, k, v])
    rows.append({"shape": "leaderboard", "eager": _summary(_ms_rounds(lb, timer, rounds))})
    save()
    table = pd.json_normalize([{**row, "shape": str(row["shape"])} for row in rows]).set_index("shape")
    print(table.filter(regex="ratio|_ms").to_markdown(floatfmt=".3f"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("export", "run"))
    p.add_argument("rev", nargs="?", help="export: the earlier revision")
    p.add_argument("dest", nargs="?", type=Path, default=Path(".ab/old"), help="export: where cs336_old goes")
    p.add_argument("--out", type=Path, default=Path("compare_revisions.json"), help="run: the JSON written")
    p.add_argument("--rounds", type=int, default=5, help="run: interleaved rounds per case")
    a = p.parse_args()
    export(a.rev, a.dest) if a.cmd == "export" else run(a.out, a.rounds)


if __name__ == "__main__":
    main()
