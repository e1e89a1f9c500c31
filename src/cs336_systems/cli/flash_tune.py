"""Tune the FlashAttention kernels on this GPU and write its shipped tuning table (kernels/flash/tune_table.py).

python -m cs336_systems.cli.flash_tune                       # the attention shapes grid and the model's case
python -m cs336_systems.cli.flash_tune --shapes grid,breadth --out /tmp/table.json

Every case is tuned afresh (the table in force and any tune cache are ignored); the keys tuned here replace
their entries in the table, the others stay. Commit the table with the figures of the run that wrote it.
"""

from __future__ import annotations

import datetime
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cs336_systems.cli.common import Parser, check_outputs

if TYPE_CHECKING:  # imports torch: imported where used, after the arguments parsed
    import torch

Shape = tuple[int, int, int, int, int, bool]  # (batch, heads, n_q, n_k, d, causal)

# The model's attention at ctx 512 (every size up to xl: batch 4, d 64; batch x heads fall in one key), in
# its layout. Its keys are also the grid's (4, 25, 512, 512, 64) case's: the set run first tunes them (the
# tuner keeps a key's choice for the process).
MODEL_SHAPES: tuple[Shape, ...] = ((4, 25, 512, 512, 64, True),)
SHAPE_SET_NAMES = ("breadth", "grid", "model")  # those of shape_sets(), whose module imports torch


def shape_sets() -> dict[str, tuple[tuple[Shape, ...], bool]]:
    """Each set's shapes, and whether they are in the model's layout."""
    from cs336_systems.harness.attention import ATTENTION_SHAPES, BREADTH_SHAPES

    return {
        "grid": (ATTENTION_SHAPES, False),
        "breadth": (BREADTH_SHAPES, False),
        "model": (MODEL_SHAPES, True),
    }


def tune_case(shape: Shape, model_layout: bool, dtype: torch.dtype) -> None:
    """Tune the three kernels of one case through a plan on tensors of the layout its callers pass: the
    grid's contiguous (batch, heads, seq, d) tensors (the attention bench's and the handout's), or the
    model's heads-major views of (batch, seq, heads, d) tensors, dO in O's layout. The layout matters: the
    Gluon kernels need contiguous tensors, and a Gluon config runs as its Triton twin otherwise, so a table
    tuned on views never picks Gluon, and the grid runs slower with it (docs/perf-notes.md, FlashAttention-2,
    "A tuning table shipped per GPU model" and "Figures moved out of docstrings")."""
    import torch

    from cs336_systems.kernels import flash

    batch, heads, n_q, n_k, d, causal = shape
    if model_layout:
        draw = lambda n: torch.randn(batch, n, heads, d, device="cuda", dtype=dtype).transpose(1, 2)
    else:
        draw = lambda n: torch.randn(batch, heads, n, d, device="cuda", dtype=dtype)
    q, k, v = draw(n_q), draw(n_k), draw(n_k)
    plan = flash.AttentionPlan(q, k, v, causal)
    o, lse = plan.forward(q, k, v)
    # The grid's dO is contiguous (O's own layout is a view: no Gluon backward); the model's is O's.
    do = torch.randn_like(o) if model_layout else torch.randn_like(q)
    plan.backward(q, k, v, o, do, lse)


def main(argv: list[str] | None = None) -> int:
    p = Parser("flash_tune", description=__doc__)
    p.add_argument("--shapes", default="grid,model", help=f"comma list of {', '.join(SHAPE_SET_NAMES)}")
    p.add_argument(
        "--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"), help="the inputs' dtype"
    )
    p.add_argument(
        "--out", type=Path, default=None, help="the table to write (default: this GPU's in the package)"
    )
    args = p.parse_args(argv)
    check_outputs(p, {"--out": (args.out, False)})
    unknown = set(args.shapes.split(",")) - set(SHAPE_SET_NAMES)
    if unknown:
        p.error(f"unknown shape sets {sorted(unknown)}; choose from {list(SHAPE_SET_NAMES)}")
    import torch
    import triton

    from cs336_systems.kernels import flash
    from cs336_systems.kernels.flash.tune_table import table_path, triton_minor, write_table

    if flash.INTERPRET or not torch.cuda.is_available():
        p.error("needs a CUDA GPU: tuning times the kernels on the device (and not under TRITON_INTERPRET)")
    device = torch.cuda.get_device_name()
    out = args.out or table_path(device)
    dtype = getattr(torch, args.dtype)
    flash.clear_tuning_cache()
    with flash.configured(autotune=True, tune_table=False, tune_cache=None):
        for name in args.shapes.split(","):
            shapes, model_layout = shape_sets()[name]
            for shape in shapes:
                tune_case(shape, model_layout, dtype)
    report = flash.tuning_report()
    tuned = {k: c for k, c in flash.TUNER.cache.items() if flash.TUNER.sources.get(k) == "tuned"}
    meta = {
        "device": device,
        "triton": triton_minor(),
        "triton_version": triton.__version__,
        "torch": torch.__version__,
        "date": datetime.date.today().isoformat(),
        "command": "python -m cs336_systems.cli.flash_tune "
        + " ".join(argv if argv is not None else sys.argv[1:]),
    }
    write_table(out, tuned, meta)
    for text, row in report["keys"].items():
        print(f"{text:55} {row['chosen']}")
    print(f"{len(tuned)} keys tuned in {report['tune_seconds']:.1f} s on {device}; table: {out}")
    if report["build_errors"]:
        print(f"candidates that did not build: {report['build_errors']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
