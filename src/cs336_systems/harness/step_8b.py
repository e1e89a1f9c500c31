"""The 8B step (D26) as a measured case: one spawn of ``training.step_8b.run_step`` per case, its
per-rank numbers combined, and the failure modes turned into results (OOM, a rank that hung).

Used by ``bench/bench_leaderboard_2026.py`` and ``python -m cs336_systems.cli.train_8b``.
"""

from __future__ import annotations

import statistics
import tempfile
from typing import Any

from cs336_systems.distributed.launch import RankFailedError, spawn
from cs336_systems.harness.train_step import combine_ranks
from cs336_systems.profiling.timing import is_oom
from cs336_systems.training.step_8b import StepOptions, run_step

TIMING = (
    "synchronized loop: each rank times each step on its host clock after torch.cuda.synchronize(); "
    "per step the max over ranks; step_s = median over the timed steps"
)


def combine_step_results(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One run's figures over ranks: per-step max over ranks (``times_ms``, ``median_ms``, ...), every
    other number the max over ranks; plus ``step_s``, model TFLOP/s per GPU and MFU against the
    slowest rank's measured bf16 matmul rate, and the mean loss over ranks of every step."""
    combined = combine_ranks(
        [{k: v for k, v in r.items() if k not in ("params", "profile")} for r in per_rank]
    )
    combined["losses"] = [statistics.fmean(ls) for ls in zip(*(r["losses"] for r in per_rank), strict=True)]
    combined["timing"] = TIMING
    if per_rank[0].get("profile"):
        combined["profile"] = per_rank[0]["profile"]
    world_size = per_rank[0]["world_size"]
    if combined["times_ms"]:
        step_s = combined["median_ms"] / 1e3
        combined["step_s"] = step_s
        combined["tflops_per_gpu"] = combined["flops_per_step"] / world_size / step_s / 1e12
        rates = [r["matmul_tflops"] for r in per_rank if r.get("matmul_tflops")]
        if rates:
            combined["matmul_tflops"] = min(rates)
            combined["mfu"] = combined["tflops_per_gpu"] / min(rates)
    for key in ("peak_allocated_mib", "peak_reserved_mib", "peak_first_steps_mib"):
        if combined.get(key) is not None:
            combined[key.replace("_mib", "_gib")] = combined[key] / 1024
    return combined


def spawn_step_8b(
    options: StepOptions, world_size: int, timeout_s: float, cold_cache: bool = True
) -> dict[str, Any]:
    """Spawn ``world_size`` ranks running ``options`` and combine their numbers. With ``cold_cache``
    the compile and autotune caches start empty (the course's cold-cache time to the first step).

    An out-of-memory on any rank gives ``{"oom": True, "error": ...}`` (the other ranks are killed);
    a run past ``timeout_s`` gives ``{"oom": False, "error": "timeout ..."}``; other failures raise."""
    with tempfile.TemporaryDirectory(prefix="cs336-8b-cache-") as cache:
        if cold_cache and options.cache_dir is None:
            from dataclasses import replace

            options = replace(options, cache_dir=cache)
        try:
            per_rank = spawn(run_step, world_size, options, timeout=timeout_s)
        except RankFailedError as exc:
            if is_oom(exc):
                return {"oom": True, "error": _oom_line(str(exc)), "label": options.label}
            raise
        except TimeoutError as exc:
            return {"oom": False, "error": f"timeout after {timeout_s:.0f} s: {exc}", "label": options.label}
    return combine_step_results(per_rank)


def _oom_line(message: str) -> str:
    lines = [line for line in message.splitlines() if "out of memory" in line.lower()]
    return (lines[0] if lines else message.splitlines()[0])[:300]


def format_summary(result: dict[str, Any]) -> str:
    """A few lines a person reads: the configuration and the figures."""
    if result.get("oom"):
        return f"{result.get('label', '')}\nOOM: {result.get('error')}"
    if result.get("error"):
        return f"{result.get('label', '')}\nfailed: {result['error']}"
    lines = [
        result["label"],
        f"world size {result['world_size']}, {result['tokens_per_rank']} tokens per rank, "
        f"{result['flops_per_step']:.3e} model FLOPs per step",
        "step s (median of timed steps, max over ranks): "
        + (
            f"{result['step_s']:.3f}  [{', '.join(f'{t / 1e3:.3f}' for t in result['times_ms'])}]"
            if result.get("step_s")
            else "-"
        ),
    ]
    if str(result.get("checkpoint_resolved", "")).startswith("keep:"):
        lines.append(
            f"checkpoint {result['checkpoint_resolved']}: the last {result['kept_blocks']} blocks not "
            f"checkpointed; predicted peak {result['predicted_peak_gib']:.1f} GiB "
            f"(keep:auto budget {result['keep_budget_gib']:.1f})"
        )
    if result.get("tflops_per_gpu"):
        mfu = f", MFU {result['mfu']:.1%} of {result['matmul_tflops']:.0f}" if result.get("mfu") else ""
        lines.append(f"model TFLOP/s per GPU {result['tflops_per_gpu']:.1f}{mfu}")
    if result.get("forward_ms") is not None:
        lines.append(
            "phases ms (mean): forward {forward_ms:.0f}, backward+sync {backward_ms:.0f}, optimizer {optimizer_ms:.0f}".format(
                **result
            )
        )
    if result.get("peak_allocated_gib") is not None:
        lines.append(
            f"peak GiB per GPU: allocated {result['peak_allocated_gib']:.1f}, reserved "
            f"{result['peak_reserved_gib']:.1f} (timed steps); first steps {result['peak_first_steps_gib']:.1f}"
        )
    lines.append(
        f"first finished step after {result['first_step_s']:.1f} s "
        f"({result.get('first_step_since_process_start_s') or float('nan'):.1f} s since process start)"
    )
    lines.append("losses: " + ", ".join(f"{x:.4f}" for x in result["losses"]))
    if result.get("profile"):
        by_cat = result["profile"]["kernel_ms_by_category"]
        lines.append(
            "device ms by kernel category (one step, rank 0): "
            + ", ".join(f"{k} {v:.0f}" for k, v in by_cat.items())
        )
        lines.append(result["profile"]["top_kernels"])
    return "\n".join(lines)
