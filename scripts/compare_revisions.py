"""Time the FlashAttention of an earlier revision and of this tree side by side, in one process: how a
refactor proves it kept every win. Both versions are reached through public entry points only (the
``attention`` package's ``get_attention_fn("flash_triton")`` and ``attention.flash_triton``'s autograd
class, which the adapters hook returns), so internals may change freely. Each case's forward+backward is
timed in interleaved rounds (order alternating; the ratio is the median of per-round ratios, so drift
cancels): ``do_bench`` and a CUDA-graph replay on a GPU, wall time on the CPU. Each version's configs are
recorded where it exposes ``kernels.flash.chosen_configs`` (informational). Cases: the attention shapes
group (bf16, 4-D) and the leaderboard case (compiled ``apply``), or ``--shapes tiny`` on the CPU (under
``TRITON_INTERPRET=1``; ``tests/test_compare_revisions.py`` runs it so that this script cannot rot).

    python scripts/compare_revisions.py export HEAD~1 .ab/old      # the old package as cs336_old
    PYTHONPATH=src:.ab/old python scripts/compare_revisions.py run --out ab.json   # on the GPU
"""

from __future__ import annotations

import argparse
import importlib
import json
import re
import statistics
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

OLD = "cs336_old"
TINY = ((1, 2, 64, 64, 32, True), (2, 1, 48, 80, 32, False))  # CPU: the interpreter's tiles, ragged too


def export(rev: str, dest: Path, repo: Path = Path(".")) -> None:
    """``src/cs336_systems`` at ``rev`` as the package ``cs336_old`` under ``dest`` (imports, registry
    strings and custom-op namespaces renamed, so both versions load and register their ops in one
    process)."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = Path(tmp) / "src.tar"
        subprocess.run(["git", "archive", "-o", archive, rev, "src/cs336_systems"], check=True, cwd=repo)
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        root = Path(tmp) / "src" / "cs336_systems"
        for path in root.rglob("*"):
            if path.is_dir():
                continue
            out = dest / OLD / path.relative_to(root)
            out.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix == ".py":
                out.write_text(re.sub(r"\bcs336_systems\b", OLD, path.read_text()))
            else:  # data: the shipped tuning tables
                out.write_bytes(path.read_bytes())


def _ms_rounds(steps: dict[str, Callable[[], None]], timer, rounds: int) -> dict[str, list[float]]:
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


def _wall_ms(step: Callable[[], None], reps: int = 3) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        step()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def _configs(package: str, case: tuple) -> dict | None:
    """The version's own account of its configs, where it has one (not part of the comparison)."""
    chosen = getattr(importlib.import_module(f"{package}.kernels.flash"), "chosen_configs", None)
    return chosen(case) if chosen is not None else None


def _time_shape(fns: dict, shape: tuple, gen, rounds: int, device: str, graph: bool) -> dict:
    """One 4-D case: each version's first call (plans, tuning, compiles) and configs, the relative
    difference of their outputs and gradients, and interleaved timings of fwd+bwd."""
    import torch

    b, h, nq, nk, d, causal = shape
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    q, k, v, do = (torch.randn(b, h, n, d, generator=gen).to(device, dtype) for n in (nq, nk, nk, nq))
    leaves = [x.requires_grad_() for x in (q, k, v)]
    steps, first_s, outs = {}, {}, {}
    for name, fn in fns.items():
        steps[name] = lambda fn=fn: fn(q, k, v, causal).backward(do)
        start = time.perf_counter()
        o = fn(q, k, v, causal)
        o.backward(do)
        torch.cuda.synchronize() if device == "cuda" else None
        first_s[name] = time.perf_counter() - start
        outs[name] = [o.detach().float(), *(x.grad.float() for x in leaves)]
        for x in leaves:
            x.grad = None
    diff = max(((a - r).norm() / r.norm()).item() for a, r in zip(outs["new"], outs["old"], strict=True))
    case = (b * h, nq, nk, d, causal, dtype)
    configs = {"old": _configs(OLD, case), "new": _configs("cs336_systems", case)}
    row = {"shape": shape, "rel_diff": diff, "first_call_s": first_s, "configs": configs}
    if device != "cuda":
        row["eager"] = _summary(_ms_rounds(steps, _wall_ms, rounds))
        return row
    import triton.testing as tt

    timer = lambda s: tt.do_bench(s, warmup=5, rep=30, grad_to_none=leaves)
    row["eager"] = _summary(_ms_rounds(steps, timer, rounds))
    if graph:  # fresh leaves: the eager steps' AccumulateGrad nodes belong to the legacy stream
        fresh = [x.detach().clone().requires_grad_() for x in leaves]
        graphed = {name: lambda fn=fn: fn(*fresh, causal).backward(do) for name, fn in fns.items()}
        gtimer = lambda s: tt.do_bench_cudagraph(s, rep=20, grad_to_none=fresh)
        row["graph"] = _summary(_ms_rounds(graphed, gtimer, 2))
    return row


def _leaderboard(classes: dict, gen, rounds: int) -> dict:
    """The leaderboard case as the handout calls it: 3-D views of one leaf, a compiled apply, do_bench."""
    import torch
    import triton.testing as tt

    q, k, v = torch.randn(3, 16, 16384, 64, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    steps = {}
    for name, cls in classes.items():
        compiled = torch.compile(cls.apply)
        steps[name] = lambda flash=compiled: flash(q, k, v, True).sum().backward()
        steps[name]()  # compiles, tunes
    timer = lambda s: tt.do_bench(s, warmup=200, rep=1000, grad_to_none=[q, k, v])
    return {"shape": "leaderboard", "eager": _summary(_ms_rounds(steps, timer, rounds))}


def run(out: Path, rounds: int, shapes: str, device: str, graph: bool) -> list[dict]:
    import torch

    from cs336_systems.harness.attention import ATTENTION_SHAPES, BREADTH_SHAPES

    packages = {"old": OLD, "new": "cs336_systems"}
    fns = {
        n: importlib.import_module(f"{p}.attention").get_attention_fn("flash_triton")
        for n, p in packages.items()
    }
    gen = torch.Generator().manual_seed(0)
    cases = {"tiny": TINY, "grid": ATTENTION_SHAPES, "all": (*ATTENTION_SHAPES, *BREADTH_SHAPES)}[shapes]
    rows: list[dict] = []
    gpu = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    save = lambda: out.write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1, default=str))
    if device == "cuda" and shapes != "tiny":  # first: the case the course ranks, should a run be cut off
        classes = {
            n: importlib.import_module(f"{p}.attention.flash_triton").FlashAttentionTriton
            for n, p in packages.items()
        }
        rows.append(_leaderboard(classes, gen, rounds))
        save()
        print("leaderboard", round(rows[-1]["eager"]["ratio"], 3), flush=True)
    for shape in cases:
        rows.append(_time_shape(fns, shape, gen, rounds, device, graph))
        save()  # a run cut off by its time limit keeps the cases it finished
        print(
            shape,
            {k: round(rows[-1][k]["ratio"], 3) for k in ("eager", "graph") if k in rows[-1]},
            flush=True,
        )
        torch.cuda.empty_cache() if device == "cuda" else None
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("cmd", choices=("export", "run"))
    p.add_argument("rev", nargs="?", help="export: the earlier revision")
    p.add_argument("dest", nargs="?", type=Path, default=Path(".ab/old"), help="export: where cs336_old goes")
    p.add_argument("--out", type=Path, default=Path("compare_revisions.json"), help="run: the JSON written")
    p.add_argument("--rounds", type=int, default=5, help="run: interleaved rounds per case")
    p.add_argument("--shapes", choices=("grid", "all", "tiny"), default="all", help="run: which cases")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--no-graph", action="store_true", help="run: skip the CUDA-graph timings")
    a = p.parse_args()
    if a.cmd == "export":
        export(a.rev, a.dest)
    else:
        run(a.out, a.rounds, a.shapes, a.device, not a.no_graph)


if __name__ == "__main__":
    main()
