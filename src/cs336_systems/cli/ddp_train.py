"""Train the LM data-parallel with one DDP variant and print its step time and communication time.

Under torchrun (one process per GPU, also across nodes):
    torchrun --nproc-per-node 2 -m cs336_systems.cli.ddp_train --variant bucketed --bucket-mb 100
Without torchrun it starts the ranks itself (gloo on CPU when there are too few GPUs):
    python -m cs336_systems.cli.ddp_train --nproc 2 --preset tiny --ctx 32 --variant naive

Prints one JSON object on rank 0: the numbers of ``cs336_systems.harness.train_step`` combined
over ranks (step times are per-step max over ranks).
"""

from __future__ import annotations

import argparse
import json
import os
from typing import TYPE_CHECKING

from cs336_systems.cli import choices
from cs336_systems.cli.common import Parser, check_outputs

if TYPE_CHECKING:  # imports torch: imported where used, after the arguments parsed
    from cs336_systems.harness.train_step import TrainCase, TrainSetup


def parse_args() -> argparse.Namespace:
    p = Parser("ddp_train", description=__doc__)
    p.add_argument(
        "--variant",
        choices=choices.DDP_VARIANTS,
        default="bucketed",
        help="the data-parallel wrapper (local: one rank's step, no communication; torch_*: torch's)",
    )
    p.add_argument("--bucket-mb", type=float, default=None, help="for bucketed / torch_ddp (default 100)")
    p.add_argument(
        "--optimizer",
        choices=choices.DDP_OPTIMIZERS,
        default="adamw",
        help="adamw (torch.optim.AdamW), sharded (ours over AdamW), zero (torch's ZeroRedundancyOptimizer)",
    )
    p.add_argument("--preset", default="xl", choices=choices.PRESET_NAMES, help="model size (Table 1 preset)")
    p.add_argument("--ctx", type=int, default=512, help="context length (tokens per sequence)")
    p.add_argument("--batch", type=int, default=4, help="global batch; the world size must divide it")
    p.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32", help="bf16 = autocast")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps before timing")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=0, help="profiled steps for the overlap share")
    p.add_argument("--trace-dir", default=None, help="keep rank 0's Chrome trace here")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    args = p.parse_args()
    check_outputs(p, {"--trace-dir": (args.trace_dir, True)})
    return args


def run(setup: TrainSetup, case: TrainCase) -> dict:
    import torch.distributed as dist

    from cs336_systems.harness.train_step import combine_ranks, run_cases

    mine = run_cases(setup, [case])[case.key]
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return combine_ranks(gathered)


def main() -> None:
    args = parse_args()
    from cs336_systems.distributed.launch import spawn
    from cs336_systems.distributed.process_group import init_distributed, shutdown
    from cs336_systems.harness.train_step import TrainCase, TrainSetup

    bucket = args.bucket_mb if args.bucket_mb is not None else 100.0
    case = TrainCase(
        args.variant, bucket if args.variant in ("bucketed", "torch_ddp") else None, args.optimizer
    )
    setup = TrainSetup(
        preset=args.preset,
        context_length=args.ctx,
        global_batch=args.batch,
        dtype=args.dtype,
        warmup=args.warmup,
        steps=args.steps,
        profile_steps=args.profile_steps,
        trace_dir=args.trace_dir,
    )
    if "RANK" in os.environ:  # torchrun
        info = init_distributed()
        try:
            result = run(setup, case)
        finally:
            shutdown()
        rank = info.rank
    else:
        result, rank = spawn(run, args.nproc, setup, case, timeout=3600)[0], 0
    if rank == 0:
        result.pop("times_ms", None)
        print(json.dumps({"case": case.key, "setup": setup.__dict__, **result}, indent=1, default=str))


if __name__ == "__main__":
    main()
