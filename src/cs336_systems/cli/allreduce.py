"""D13 all-reduce timing for one backend and world size (the bench's method, outside pytest).

torchrun --nproc-per-node 4 -m cs336_systems.cli.allreduce                 # nccl, 1MB..1GB
python -m cs336_systems.cli.allreduce --nproc 4 --backend gloo --sizes 1MB,10MB
"""

from __future__ import annotations

import os

from cs336_systems.cli.common import Parser

SIZE_NAMES = "1MB,10MB,100MB,1GB"  # distributed.allreduce.SIZES's names: that module imports torch


def main() -> None:
    p = Parser("allreduce", description=__doc__)
    p.add_argument(
        "--backend", choices=("gloo", "nccl"), default=None, help="default: nccl if GPUs suffice, else gloo"
    )
    p.add_argument("--sizes", default=SIZE_NAMES, help=f"comma list of {SIZE_NAMES.replace(',', ', ')}")
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not under torchrun")
    args = p.parse_args()
    from cs336_systems.distributed.allreduce import SIZES, allreduce_sweep
    from cs336_systems.distributed.launch import spawn
    from cs336_systems.distributed.process_group import init_distributed, shutdown

    if unknown := [s for s in args.sizes.split(",") if s not in SIZES]:
        p.error(f"--sizes: unknown size {', '.join(unknown)} (the sizes: {', '.join(SIZES)})")
    sizes = [SIZES[s] for s in args.sizes.split(",")]
    if "RANK" in os.environ:
        info = init_distributed(args.backend)
        try:
            results = allreduce_sweep(sizes)
        finally:
            shutdown()
        rank = info.rank
    else:
        results, rank = spawn(allreduce_sweep, args.nproc, sizes, backend=args.backend, timeout=1800)[0], 0
    if rank == 0:
        print(
            f"{'backend':8} {'ranks':>5} {'bytes':>11} {'mean ms':>9} {'max ms':>9} {'algbw GB/s':>10} {'busbw GB/s':>10}"
        )
        for nbytes, r in results.items():
            print(
                f"{r['backend']:8} {r['world_size']:>5} {nbytes:>11} {r['mean_ms']:>9.3f} {r['max_ms']:>9.3f} "
                f"{r['algbw_gbps']:>10.2f} {r['busbw_gbps']:>10.2f}"
            )


if __name__ == "__main__":
    main()
