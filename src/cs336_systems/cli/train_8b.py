"""D26: time one full training step of the 8B model (or any preset) on N GPUs.

    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b                    # the suite's pieces
    torchrun --nproc-per-node 2 -m cs336_systems.cli.train_8b --fsdp torch --attention sdpa \\
        --loss chunked --optimizer torch_fused --compile                          # torch's built-ins
    python -m cs336_systems.cli.train_8b --nproc 2 ...                           # spawns the ranks itself

Every piece of the step is a flag (``cs336_systems.training.step_8b`` says what each selects), so a
run with one flag changed shows what that piece buys. Rank 0 prints step time (median of the timed
steps, each the max over ranks), model TFLOP/s per GPU, MFU against the measured bf16 matmul rate, peak
memory per GPU and the time to the first finished step; ``--json`` writes the same figures.
``--cache-dir`` points the compile and autotune caches at a directory (an empty one gives the course's
cold-cache time to the first step).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from typing import Any

from cs336_systems.harness.step_8b import combine_step_results, run_case
from cs336_systems.model import PRESETS
from cs336_systems.training.step_8b import (
    FSDP_CHOICES,
    LOSS_CHOICES,
    OPTIMIZER_CHOICES,
    StepOptions,
    run_step,
)

OVERRIDES = ("d_model", "d_ff", "num_layers", "num_heads", "vocab_size", "context_length")


def build_parser() -> argparse.ArgumentParser:
    d = StepOptions()
    p = argparse.ArgumentParser(
        prog="python -m cs336_systems.cli.train_8b", description=__doc__.split("\n")[0]
    )
    p.add_argument("--preset", default=d.preset, choices=sorted(PRESETS))
    p.add_argument(
        "--fsdp", default=d.fsdp, choices=FSDP_CHOICES, help="ours | torch (FSDP2) | none (1 rank)"
    )
    p.add_argument(
        "--attention", default=d.attention, help="attention registry name (flash_triton, sdpa, ...)"
    )
    p.add_argument("--loss", default=d.loss, choices=LOSS_CHOICES)
    p.add_argument("--loss-chunk-tokens", type=int, default=d.loss_chunk_tokens, help="for --loss chunked")
    p.add_argument("--optimizer", default=d.optimizer, choices=OPTIMIZER_CHOICES)
    p.add_argument("--checkpoint", default=d.checkpoint, help="none | every:K")
    p.add_argument("--compile", action="store_true", help="torch.compile each block's forward")
    p.add_argument("--compute-dtype", default=d.compute_dtype, choices=("bf16", "fp32"))
    p.add_argument("--reduce-dtype", default=d.reduce_dtype, choices=("bf16", "fp32"))
    p.add_argument("--batch-per-rank", type=int, default=d.batch_per_rank)
    p.add_argument("--seq-len", type=int, default=None, help="default: the preset's context length")
    p.add_argument("--warmup", type=int, default=d.warmup, help="untimed steps after the first")
    p.add_argument("--steps", type=int, default=d.steps, help="timed steps")
    p.add_argument("--profile", action="store_true", help="one more step under torch.profiler (top kernels)")
    p.add_argument("--cache-dir", default=None, help="compile/autotune cache directory")
    p.add_argument("--nproc", type=int, default=None, help="without torchrun: spawn this many ranks")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a spawned run is killed")
    p.add_argument("--json", default=None, help="write the combined figures here (rank 0)")
    for name in OVERRIDES:
        p.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help=f"override the preset's {name}"
        )
    return p


def options_from_args(args: argparse.Namespace) -> StepOptions:
    changes = {name: getattr(args, name) for name in OVERRIDES if getattr(args, name) is not None}
    return StepOptions(
        preset=args.preset,
        model_changes=changes,
        batch_per_rank=args.batch_per_rank,
        seq_len=args.seq_len,
        fsdp=args.fsdp,
        attention=args.attention,
        loss=args.loss,
        loss_chunk_tokens=args.loss_chunk_tokens,
        optimizer=args.optimizer,
        checkpoint=args.checkpoint,
        compile=args.compile,
        compute_dtype=args.compute_dtype,
        reduce_dtype=args.reduce_dtype,
        warmup=args.warmup,
        steps=args.steps,
        profile=args.profile,
        cache_dir=args.cache_dir,
    )


def format_summary(result: dict[str, Any]) -> str:
    """A few lines a person reads: the configuration and the figures."""
    if result.get("oom"):
        return f"{result.get('label', '')}\nOOM: {result.get('error')}"
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
            f"peak GiB per GPU: allocated {result['peak_allocated_gib']:.1f}, reserved {result['peak_reserved_gib']:.1f}"
        )
    lines.append(
        f"first finished step after {result['first_step_s']:.1f} s "
        f"({result.get('first_step_since_process_start_s') or float('nan'):.1f} s since process start)"
    )
    lines.append("losses: " + ", ".join(f"{x:.4f}" for x in result["losses"]))
    if result.get("profile"):
        lines.append(result["profile"])
    return "\n".join(lines)


def _torchrun_rank(options: StepOptions) -> dict[str, Any] | None:
    """Under torchrun: join the group, run, gather every rank's numbers on rank 0."""
    import torch.distributed as dist

    from cs336_systems.distributed.process_group import init_distributed, shutdown

    init_distributed()
    try:
        mine = run_step(options)
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        return combine_step_results(gathered) if dist.get_rank() == 0 else None
    finally:
        shutdown()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    options = options_from_args(args)
    if "RANK" in os.environ:
        result = _torchrun_rank(options)
    elif args.nproc:
        result = run_case(options, args.nproc, args.timeout, cold_cache=False)
    elif options.fsdp == "none":
        result = combine_step_results([run_step(options)])
    else:
        print("start under torchrun, or pass --nproc N (or --fsdp none for one process)", file=sys.stderr)
        return 2
    if result is None:  # ranks other than 0
        return 0
    print(format_summary(result))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({k: v for k, v in result.items()}, fh, indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
