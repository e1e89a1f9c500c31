"""D26: time one full training step of the 8B model (or any preset) on N GPUs.

    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b                     # the suite's pieces
    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b --recipe torch --compile   # torch's
    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b --attention sdpa    # one piece swapped
    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b --compile --checkpoint keep:auto  # spare memory
    python -m cs336_systems.cli.train_8b --nproc 2 ...                            # spawns the ranks itself

``--recipe ours`` (default) or ``--recipe torch`` sets every piece; each piece flag then overrides one
(``cs336_systems.training.step_8b`` says what each selects), so a run with one flag changed shows what
that piece buys. Rank 0 prints the step time (median of the timed steps, each the max over ranks),
model TFLOP/s per GPU, MFU against the measured bf16 matmul rate, peak memory per GPU and the time to
the first finished step; ``--json`` writes the same figures. ``--cache-dir`` points the compile and
autotune caches at a directory (an empty one gives the course's cold-cache time to the first step, and
the exit status is 1 when the run ends more than ``--cold-start-limit-s``, default 600, after process
start). ``--course-timing`` adds the course's ``do_bench(rep=30000, warmup=10000)`` mean (about 14 more
steps; ``--course-rep-ms`` / ``--course-warmup-ms`` shorten it). MFU is printed over the measured matmul
rate and over the GPU's dense bf16 peak, with the FLOP formula.
Without CUDA, the recipe's Triton pieces (attention, fused loss, FusedAdamW) become torch's, said in one
line, so a small preset runs on a CPU (``--fsdp none --preset tiny``); each step prints a line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cs336_systems.cli import choices
from cs336_systems.cli.common import Parser, check_outputs
from cs336_systems.rows.contention import (
    INTERPRETER_NOTE,
    contention_facts,
    contention_reasons,
    interpreted,
)

if TYPE_CHECKING:  # imports torch: imported where used, after the arguments parsed
    from cs336_systems.training.step_8b import StepOptions

OVERRIDES = ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length")
PIECES = (
    "fsdp",
    "attention",
    "loss",
    "optimizer",
    "checkpoint",
    "save_attention",
    "save_matmuls",
    "optimizer_in_backward",
)


def build_parser() -> argparse.ArgumentParser:
    d = argparse.Namespace(**choices.STEP_DEFAULTS)
    p = Parser("train_8b", description=__doc__)
    p.add_argument("--recipe", default="ours", choices=choices.RECIPE_NAMES, help="every piece at once")
    p.add_argument(
        "--preset", default=d.preset, choices=choices.PRESET_NAMES, help="model size (8B: the leaderboard's)"
    )
    pieces = p.add_argument_group("pieces (default: the recipe's)")
    pieces.add_argument(
        "--fsdp", choices=choices.FSDP_CHOICES, help="ours | torch (FSDP2) | none (one process)"
    )
    pieces.add_argument("--attention", help="attention registry name (flash_triton, sdpa, ...)")
    pieces.add_argument(
        "--loss",
        choices=choices.LOSS_CHOICES,
        help="fused (the fused LM-head + cross-entropy kernel), chunked (torch over checkpointed chunks), "
        "full (full logits)",
    )
    pieces.add_argument(
        "--optimizer",
        choices=choices.OPTIMIZER_CHOICES,
        help="fused_ours (the suite's Triton AdamW) or torch_fused (torch.optim.AdamW(fused=True))",
    )
    pieces.add_argument(
        "--checkpoint",
        help="none | every:1 | keep:N (the last N blocks not checkpointed) | keep:auto (the most that fit "
        "--keep-budget-gib by the accounting's predicted peak)",
    )
    p.add_argument(
        "--keep-budget-gib",
        type=float,
        default=None,
        help="peak budget per GPU for --checkpoint keep:auto (default: 80%% of the GPU's memory)",
    )
    pieces.add_argument(
        "--save-attention",
        action=argparse.BooleanOptionalAction,
        help="checkpointed blocks keep attention's output instead of re-running it",
    )
    pieces.add_argument(
        "--save-matmuls",
        action=argparse.BooleanOptionalAction,
        help="checkpointed blocks also keep every matmul's output: the re-run recomputes elementwise work "
        "only (more memory per block; off by default)",
    )
    pieces.add_argument(
        "--optimizer-in-backward",
        action=argparse.BooleanOptionalAction,
        help="each FSDP unit's AdamW steps as its gradient shard is reduced, which is then freed (ours FSDP; "
        "with --grad-clip the plain step runs, said in a line)",
    )
    p.add_argument(
        "--grad-clip", type=float, default=None, help="clip the global gradient norm (default: none)"
    )
    p.add_argument(
        "--course-timing",
        action="store_true",
        help="after the timed steps, the course's protocol: triton do_bench(rep, warmup) mean",
    )
    p.add_argument(
        "--course-rep-ms",
        type=int,
        default=d.course_rep_ms,
        help="do_bench rep, ms (the course's protocol)",
    )
    p.add_argument(
        "--course-warmup-ms",
        type=int,
        default=d.course_warmup_ms,
        help="do_bench warm-up, ms (the course's protocol)",
    )
    p.add_argument(
        "--cold-start-limit-s",
        type=float,
        default=d.cold_start_limit_s,
        help="with an empty --cache-dir: exit 1 when the run ends later than this after process start",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile each block's forward")
    p.add_argument("--loss-chunk-tokens", type=int, default=d.loss_chunk_tokens, help="for --loss chunked")
    p.add_argument(
        "--compute-dtype",
        default=d.compute_dtype,
        choices=("bf16", "fp32"),
        help="what the gathered weights (and so the activations) are cast to",
    )
    p.add_argument(
        "--reduce-dtype",
        default=d.reduce_dtype,
        choices=("bf16", "fp32"),
        help="gradients are reduced in this",
    )
    p.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank, help="sequences per rank and step")
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's context length")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps after the first")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler (top kernels)")
    p.add_argument("--cache-dir", default=None, help="compile/autotune cache directory")
    p.add_argument("--nproc", type=int, default=None, help="without torchrun: spawn this many ranks")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a spawned run is killed")
    p.add_argument("--json", type=Path, default=None, help="write the combined figures here (rank 0)")
    p.add_argument(
        "--progress",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="a line per step on stderr (rank 0)",
    )
    for name in OVERRIDES:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}"
        )
    return p


def options_from_args(args: argparse.Namespace) -> StepOptions:
    from cs336_systems.training.step_8b import recipe

    model_changes = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    pieces = {name: getattr(args, name) for name in PIECES if getattr(args, name) is not None}
    return recipe(
        args.recipe,
        **pieces,
        preset=args.preset,
        model_changes=model_changes,
        batch_per_rank=args.batch_per_rank,
        seq_len=args.seq_len,
        loss_chunk_tokens=args.loss_chunk_tokens,
        keep_budget_gib=args.keep_budget_gib,
        compile=args.compile,
        grad_clip=args.grad_clip,
        course_timing=args.course_timing,
        course_rep_ms=args.course_rep_ms,
        course_warmup_ms=args.course_warmup_ms,
        cold_start_limit_s=args.cold_start_limit_s,
        compute_dtype=args.compute_dtype,
        reduce_dtype=args.reduce_dtype,
        warmup=args.warmup,
        steps=args.steps,
        profile=args.profile,
        cache_dir=args.cache_dir,
        progress=args.progress,
    )


def fit_to_machine(args: argparse.Namespace, options: StepOptions) -> StepOptions:
    """Without CUDA (and without Triton's interpreter) our Triton pieces cannot run: those the recipe
    chose become torch's, said in one line; one asked for by flag is an error naming the flags that
    run here (``ValueError``, whose message ``main`` prints as one line)."""
    import torch

    from cs336_systems.kernels.checks import INTERPRET
    from cs336_systems.training.options import TRITON_PIECES, triton_pieces, without_triton

    if torch.cuda.is_available() or INTERPRET:
        return options
    asked = {f: v for f, v in triton_pieces(options).items() if getattr(args, f) is not None}
    if asked:
        flags = " ".join(f"--{f} {v}" for f, v in asked.items())
        works = " ".join(f"--{f} {torch_piece}" for f, (_, torch_piece) in TRITON_PIECES.items())
        raise ValueError(
            f"{flags} runs Triton kernels, which need CUDA (or TRITON_INTERPRET=1 on a CPU, "
            f"minutes per step); without CUDA use {works}"
        )
    options, swaps = without_triton(options)
    if swaps:
        pieces = ", ".join(f"--{f} {v}" for f, v in swaps.items())
        print(
            f"no CUDA: torch's pieces instead of our Triton kernels ({pieces}); TRITON_INTERPRET=1 runs "
            "ours in Triton's interpreter (minutes per step)",
            file=sys.stderr,
        )
    return options


def _torchrun_rank(options: StepOptions) -> dict[str, Any] | None:
    """Under torchrun: join the group, run, gather every rank's numbers on rank 0."""
    import torch.distributed as dist

    from cs336_systems.distributed.process_group import init_distributed, shutdown
    from cs336_systems.harness.step_8b import combine_step_results
    from cs336_systems.training.step_8b import run_step

    init_distributed()
    try:
        mine = run_step(options)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return combine_step_results(gathered) if dist.get_rank() == 0 else None
    finally:
        shutdown()


def judged(result: dict[str, Any], device_name: str) -> list[str]:
    """The lines a step's figures need besides the summary: the same reliability verdict as
    every bench row (recorded in ``result['contention']`` too) and MFU both ways with its FLOP count."""
    from cs336_systems.profiling.flops import STEP_8B_FLOP_FORMULA, mfu_both

    if not result.get("times_ms"):
        return []
    result.update(contention_facts(result["times_ms"]))
    on_cpu = device_name.lower().startswith("cpu")
    # TRITON_INTERPRET=1 keeps our Triton pieces on a CPU (fit_to_machine): the interpreter's time
    if interpreted(result.get("options") or {}, on_cpu):
        result["contention"] = INTERPRETER_NOTE
        return [f"interpreted: {INTERPRETER_NOTE}"]
    lines = []
    reasons = contention_reasons(result, on_cpu)
    if reasons:
        result["contention"] = "; ".join(reasons)
        lines.append(f"unreliable timing: {result['contention']}; the step time and ratios measure the load")
    if result.get("tflops_per_gpu"):
        rate = result.get("matmul_tflops")
        both = mfu_both(result["tflops_per_gpu"] * 1e12, rate * 1e12 if rate else None, device_name)
        result["mfu_peak"] = both.get("mfu_peak")
        lines.append(f"{both['mfu_note']}; {STEP_8B_FLOP_FORMULA}")
    return lines


def _device_name() -> str:
    import torch

    from cs336_systems.harness.environment import device_name

    return device_name("cuda" if torch.cuda.is_available() else "cpu")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_outputs(parser, {"--json": (args.json, False)})  # written after the run: checked before it
    try:
        options = fit_to_machine(args, options_from_args(args))
    except ValueError as exc:  # a bad combination of flags: one line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2
    from cs336_systems.harness.step_8b import combine_step_results, format_summary, spawn_step_8b
    from cs336_systems.training.step_8b import run_step

    if "RANK" in os.environ:
        result = _torchrun_rank(options)
    elif args.nproc:
        result = spawn_step_8b(options, args.nproc, args.timeout, cold_cache=False)
    elif options.fsdp == "none":
        result = combine_step_results([run_step(options)])
    else:
        print("start under torchrun, or pass --nproc N (or --fsdp none for one process)", file=sys.stderr)
        return 2
    if result is None:  # ranks other than 0
        return 0
    print(format_summary(result))
    for line in judged(result, _device_name()):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=1, default=str)
    if result.get("cold_start_ok") is False:  # from empty caches past the course's limit
        print(f"error: cold start past {result['cold_start_limit_s']:g} s", file=sys.stderr)
        return 1
    return 0 if not result.get("error") else 1


if __name__ == "__main__":
    raise SystemExit(main())
