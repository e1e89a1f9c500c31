"""The 8B step (D26) as a measured case: one spawn of ``training.step_8b.run_step`` per case, its
per-rank numbers combined, and the failure modes turned into results (OOM, a rank that hung).

Used by ``bench/bench_leaderboard_2026.py`` and ``python -m cs336_systems.cli.train_8b``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch

from cs336_systems.distributed.launch import RankFailedError, spawn
from cs336_systems.harness.record import log_case, record_not_run, record_oom, record_times
from cs336_systems.harness.settings import Settings
from cs336_systems.harness.train_step import combine_ranks
from cs336_systems.model import get_preset
from cs336_systems.profiling.timing import is_oom
from cs336_systems.training.course_timing import COLD_START_LIMIT_S, cold_start_verdict
from cs336_systems.training.options import (
    FLOP_FORMULA,
    dense_bf16_peak_tflops,
    proxy_checkpoint_policy,
    recipe,
)
from cs336_systems.training.step_8b import StepOptions, run_step, step_checkpoint_policy

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
        add_mfu(combined, per_rank)
    add_cold_start(combined, per_rank)
    for key in ("peak_allocated_mib", "peak_reserved_mib", "peak_first_steps_mib"):
        if combined.get(key) is not None:
            combined[key.replace("_mib", "_gib")] = combined[key] / 1024
    return combined


def add_mfu(combined: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    """MFU two ways, the formula named: over the slowest rank's measured bf16 matmul rate
    (``mfu_measured``; ``mfu`` keeps that meaning) and over the GPU's dense bf16 peak (``mfu_peak``);
    the course protocol's mean, where measured, gets its model TFLOP/s too."""
    combined["flop_formula"] = FLOP_FORMULA
    per_gpu = combined["flops_per_step"] / per_rank[0]["world_size"]
    rates = [r["matmul_tflops"] for r in per_rank if r.get("matmul_tflops")]
    if rates:
        combined["matmul_tflops"] = min(rates)
        combined["mfu"] = combined["mfu_measured"] = combined["tflops_per_gpu"] / min(rates)
    peak = dense_bf16_peak_tflops(per_rank[0].get("device_name"))
    if peak:
        combined["peak_tflops"] = peak
        combined["mfu_peak"] = combined["tflops_per_gpu"] / peak
    if combined.get("course_mean_ms"):
        course = per_gpu / (combined["course_mean_ms"] / 1e3) / 1e12
        combined["course_tflops_per_gpu"] = course
        if rates:
            combined["course_mfu_measured"] = course / min(rates)
        if peak:
            combined["course_mfu_peak"] = course / peak


def add_cold_start(combined: dict[str, Any], per_rank: list[dict[str, Any]]) -> None:
    """``cold_start_ok``: whether a run from empty caches ended (slowest rank, since process start)
    within ``cold_start_limit_s``; None when the caches were warm."""
    limit = per_rank[0]["options"].get("cold_start_limit_s", COLD_START_LIMIT_S)
    cold = all(r.get("cold_cache") for r in per_rank)
    runs = [r.get("run_since_process_start_s") for r in per_rank]
    run_s = None if None in runs else max(runs)
    combined["cold_start_limit_s"] = limit
    combined["cold_start_ok"] = cold_start_verdict(run_s, cold, limit)


def spawn_step_8b(
    options: StepOptions, world_size: int, timeout_s: float, cold_cache: bool = True
) -> dict[str, Any]:
    """Spawn ``world_size`` ranks running ``options`` and combine their numbers. With ``cold_cache``
    the compile and autotune caches start empty (the course's cold-cache time to the first step).

    An out-of-memory on any rank gives ``{"oom": True, "error": ...}`` (the other ranks are killed);
    a run past ``timeout_s`` gives ``{"oom": False, "error": "timeout ..."}``; other failures raise."""
    with tempfile.TemporaryDirectory(prefix="cs336-8b-cache-") as cache:
        if cold_cache and options.cache_dir is None:
            options = replace(options, cache_dir=cache)
        try:
            per_rank = spawn(run_step, world_size, options, timeout=timeout_s)
        except RankFailedError as exc:
            if is_oom(exc):
                return {"oom": True, "error": _oom_line(str(exc)), "label": options.label}
            raise
        except TimeoutError as exc:
            error = f"timeout after {timeout_s:.0f} s: {exc}"
            return {"oom": False, "timed_out": True, "error": error, "label": options.label}
    return combine_step_results(per_rank)


# The per-GPU proxy's rows (issue 37): both recipes, then ours with one piece swapped for torch's.
PROXY_ROWS: dict[str, tuple[str, dict[str, Any]]] = {
    "torch": ("torch", {}),
    "ours": ("ours", {}),
    "sdpa": ("ours", {"attention": "sdpa"}),
    "chunked_loss": ("ours", {"loss": "chunked"}),
    "torch_adamw": ("ours", {"optimizer": "torch_fused"}),
    "full_recompute": ("ours", {"save_attention": False}),
    # Not a swap: the selective checkpointing option (matmul outputs kept too), last so that the group's
    # time budget drops it first; not the default until this row shows it pays.
    "save_matmuls": ("ours", {"save_matmuls": True}),
}


def proxy_options(row: str, s: Settings) -> StepOptions:
    """The 8B configuration with ``s.step8b_proxy_layers`` blocks at ``s.step8b_proxy_seq`` tokens, one
    sequence, unsharded on one GPU, compiled blocks. Checkpointing as the two-GPU bench's compiled rows:
    torch's every block; ours ``s.step8b_ours_checkpoint``, where keep:auto becomes the share of blocks
    the two-GPU step keeps under the same per-GPU budget (``proxy_checkpoint_policy``)."""
    if row not in PROXY_ROWS:
        raise ValueError(f"unknown proxy row {row!r}; choose one of {list(PROXY_ROWS)}")
    name, changes = PROXY_ROWS[row]
    model_changes: dict[str, Any] = {"num_layers": s.step8b_proxy_layers}
    if s.step8b_proxy_seq > get_preset("8B").context_length:
        model_changes["context_length"] = s.step8b_proxy_seq
    options = recipe(
        name,
        **changes,
        preset="8B",
        model_changes=model_changes,
        seq_len=s.step8b_proxy_seq,
        batch_per_rank=1,
        fsdp="none",
        compile=True,
        warmup=1,
        steps=s.step8b_proxy_steps,
        keep_budget_gib=s.step8b_keep_budget_gib,
    )
    if name != "ours":
        return options
    policy = s.step8b_ours_checkpoint
    return replace(options, checkpoint=proxy_checkpoint_policy(options) if policy == "keep:auto" else policy)


# The proxy's figures shown as the table's columns; a row's other numbers go under extra_info["details"].
PROXY_VALUES = (
    "step_s",
    "mfu",
    "tflops_per_gpu",
    "matmul_tflops",
    "peak_allocated_gib",
    "first_step_s",
    "kept_blocks",
    "forward_ms",
    "backward_ms",
    "optimizer_ms",
)


def run_proxy_row(
    benchmark: Any, row: str, options: StepOptions, timeout_s: float, measured: dict[str, dict[str, float]]
) -> dict[str, Any]:
    """One proxy row: ``options`` in a fresh process with empty caches, recorded on ``benchmark`` with
    its step time over the ``torch`` and ``ours`` rows' in ``measured`` (this run's, updated here)
    and its first step's delay after torch's. Returns the spawn's result."""
    result = spawn_step_8b(options, 1, timeout_s, cold_cache=True)
    more = _proxy_row_fields(row, options)
    if result.get("step_s"):
        measured[row] = {"step_s": result["step_s"], "first_step_s": result["first_step_s"]}
        for base in ("torch", "ours"):
            if base in measured and base != row:
                more[f"vs_{base}"] = result["step_s"] / measured[base]["step_s"]
        if "torch" in measured and row != "torch":
            more["first_step_vs_torch_s"] = result["first_step_s"] - measured["torch"]["first_step_s"]
    info = step_extra_info(options, result, 1, values=PROXY_VALUES, **more)
    record_step(benchmark, options, result, info)
    return result


def record_proxy_skip(benchmark: Any, row: str, options: StepOptions, reason: str) -> None:
    """A proxy row that was not started (the group's budget spent), with the descriptors of a run row
    (batch, seq, layers, pieces), so that the table names what is missing."""
    info = step_extra_info(options, {}, 1, values=PROXY_VALUES, **_proxy_row_fields(row, options))
    record_not_run(benchmark, "skipped", reason, **info)
    log_case(benchmark)


def _proxy_row_fields(row: str, options: StepOptions) -> dict[str, Any]:
    recipe_name, swapped = PROXY_ROWS[row]
    return dict(row=row, recipe=recipe_name, swapped=swapped, layers=options.model_config().num_layers)


def step_extra_info(
    options: StepOptions,
    result: dict[str, Any],
    world_size: int,
    values: Sequence[str] | None = None,
    **more: Any,
) -> dict[str, Any]:
    """A spawned step's figures as a bench row's extra_info: the scalar figures (only ``values`` of
    them when given, the others under ``details``, so the report's table stays narrow), the kernel
    time by category, the losses, the pieces, the shape and ``more``."""
    scalars = {
        k: v
        for k, v in result.items()
        if k not in ("options", "times_ms", "profile") and not isinstance(v, dict | list)
    }
    info = scalars if values is None else {k: v for k, v in scalars.items() if k in values}
    if values is not None:
        info["details"] = {k: v for k, v in scalars.items() if k not in values}
    if result.get("profile"):
        info["kernel_ms_by_category"] = result["profile"]["kernel_ms_by_category"]
    info.update(
        losses=result.get("losses"),
        pieces={k: getattr(options, k) for k in ("fsdp", "attention", "loss", "optimizer", "checkpoint")}
        | {
            "save_attention": options.save_attention,
            "optimizer_in_backward": options.optimizer_in_backward,
            "compile": options.compile,
        },
        preset=options.preset,
        batch=options.batch_per_rank * world_size,
        seq=options.sequence_length,
        world_size=world_size,
        warmup_steps=1 + options.warmup,  # the first (cold) step, then `warmup` more
        timed_steps=options.steps,
        device_name=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        **more,
    )
    # An OOM row has no rank's numbers: the policy keep:auto resolves to, computed here the same way.
    info.setdefault("checkpoint_resolved", step_checkpoint_policy(options, world_size))
    return info


def record_step(benchmark: Any, options: StepOptions, result: dict[str, Any], info: dict[str, Any]) -> None:
    """One spawned step as a bench row (``info`` from :func:`step_extra_info`): timed steps, an OOM
    row, or a not-run row whose status is ``timeout`` or ``failed``; logged to the JSONL row log and
    summarized on stdout."""
    if result.get("oom"):
        record_oom(benchmark, **info)
    elif result.get("error"):
        record_not_run(benchmark, "timeout" if result.get("timed_out") else "failed", result["error"], **info)
    else:
        record_times(benchmark, result["times_ms"], **info)
    log_case(benchmark)
    print(f"\n[{time.strftime('%H:%M:%S')}] {format_summary(result | {'label': options.label})}", flush=True)


def _oom_line(message: str) -> str:
    lines = [line for line in message.splitlines() if "out of memory" in line.lower()]
    return (lines[0] if lines else message.splitlines()[0])[:300]


def mfu_line(result: dict[str, Any]) -> str:
    """Model TFLOP/s per GPU and MFU both ways, with the FLOP formula named."""
    parts = [f"model TFLOP/s per GPU {result['tflops_per_gpu']:.1f}"]
    if result.get("mfu_measured"):
        parts.append(
            f"MFU {result['mfu_measured']:.1%} of the measured {result['matmul_tflops']:.0f} TFLOP/s"
        )
    if result.get("mfu_peak"):
        parts.append(f"{result['mfu_peak']:.1%} of the {result['peak_tflops']:.0f} dense bf16 peak")
    return ", ".join(parts) + f" [FLOPs: {result.get('flop_formula', FLOP_FORMULA)}]"


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
        lines.append(mfu_line(result))
    if result.get("course_mean_ms"):
        lines.append(
            f"course protocol do_bench(rep={result['course_rep_ms']:.0f}, warmup={result['course_warmup_ms']:.0f}): "
            f"mean {result['course_mean_ms'] / 1e3:.3f} s over {result['course_n_repeat']} steps "
            f"(+{result['course_n_warmup']} warm-up, estimate {result['course_estimate_ms'] / 1e3:.3f} s; "
            f"{result['course_wall_s']:.0f} s in all)"
        )
        lines.append(
            f"course protocol: model TFLOP/s per GPU {result['course_tflops_per_gpu']:.1f}"
            + (
                f", MFU {result['course_mfu_measured']:.1%} of measured"
                if result.get("course_mfu_measured")
                else ""
            )
            + (f", {result['course_mfu_peak']:.1%} of peak" if result.get("course_mfu_peak") else "")
        )
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
    if result.get("cold_start_ok") is not None:
        verdict = "within" if result["cold_start_ok"] else "PAST"
        lines.append(
            f"cold start: the run from empty caches ended {result['run_since_process_start_s']:.0f} s after "
            f"process start, {verdict} the course's {result['cold_start_limit_s']:g} s"
        )
    if result.get("optimizer_in_backward_note"):
        lines.append(f"optimizer in backward: {result['optimizer_in_backward_note']}")
    lines.append("losses: " + ", ".join(f"{x:.4f}" for x in result["losses"]))
    if result.get("profile"):
        by_cat = result["profile"]["kernel_ms_by_category"]
        lines.append(
            "device ms by kernel category (one step, rank 0): "
            + ", ".join(f"{k} {v:.0f}" for k, v in by_cat.items())
        )
        lines.append(result["profile"]["top_kernels"])
    return "\n".join(lines)
