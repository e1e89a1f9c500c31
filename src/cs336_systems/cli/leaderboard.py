"""The 2025 leaderboard case timed the course's way, ours against SDPA's cuDNN backend.

    python -m cs336_systems.cli.leaderboard --json lb.json                    # the shipped table's choice
    python -m cs336_systems.cli.leaderboard --dkdv q64-k64-w4-s2-tma-gluon    # a dK/dV config forced

The course's 2025 leaderboard protocol (D12, docs/deliverables.md), ``cases.LEADERBOARD_CASE``: ``q, k, v =
torch.randn(3, *LEADERBOARD_CASE.shape, bf16, requires_grad=True)`` (one leaf, unpacked), ``flash =
torch.compile(FlashAttention2.apply)``, ``flash(q, k, v, causal).sum().backward()`` timed by
``triton.testing.do_bench(rep, warmup)``, mean, gradients never zeroed. cuDNN gets the same tensors as
views with a batch of 1. The impls run in the order given (``ours,cudnn,ours`` shows drift).
Each row records what ran (``flash.launched_info``) and the tuner's report.
"""

from __future__ import annotations

import contextlib
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING

from cs336_systems.cli.common import Parser, check_outputs
from cs336_systems.grading.shared.cases import LEADERBOARD_CASE

if TYPE_CHECKING:
    import torch

# torch, Triton and the kernels are imported where they run: ``--help`` and a bad ``--json`` need none.


def _dtype() -> torch.dtype:
    from cs336_systems.grading.shared.dtypes import DTYPES

    return DTYPES[LEADERBOARD_CASE.dtype]


def _case() -> tuple:
    """The kernels' key for the case: (batch x heads, n_queries, n_keys, d, causal, dtype)."""
    return (*LEADERBOARD_CASE.attention_shape, LEADERBOARD_CASE.causal, _dtype())


def _cudnn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=is_causal)[0]


def _forced(dkdv: str | None) -> contextlib.AbstractContextManager:
    if dkdv is None:
        return contextlib.nullcontext()
    import torch

    from cs336_systems.kernels import flash

    (config,) = [c for c in flash.gpu_candidates("dkdv", 64, torch.bfloat16) if str(c) == dkdv]
    return flash.forced("dkdv", config)


def time_case(impl: str, rep: int, warmup: int) -> dict[str, object]:
    import torch
    import triton.testing as tt

    from cs336_systems.attention.flash_triton import FlashAttentionTriton
    from cs336_systems.kernels import flash

    torch.manual_seed(0)
    shape, causal = LEADERBOARD_CASE.shape, LEADERBOARD_CASE.causal
    q, k, v = torch.randn(3, *shape, device="cuda", dtype=_dtype(), requires_grad=True)
    fn = torch.compile(FlashAttentionTriton.apply) if impl == "ours" else _cudnn
    step = lambda: fn(q, k, v, causal).sum().backward()
    step()  # compiles and tunes (do_bench's warm-up would too, inside its estimate)
    ms = tt.do_bench(step, rep=rep, warmup=warmup, return_mode="mean")
    row: dict[str, object] = {"impl": impl, "mean_ms": ms}
    if impl == "ours":
        case = _case()
        row.update(flash.launched_info(case), configs=flash.chosen_configs(case))
        row["sources"] = flash.config_sources(case)
    return row


def main(argv: list[str] | None = None) -> None:
    p = Parser("leaderboard", description=__doc__)
    p.add_argument("--impls", default="ours,cudnn,ours", help="comma-separated: ours, cudnn")
    p.add_argument("--rep", type=int, default=LEADERBOARD_CASE.rep_ms, help="do_bench rep, ms (the course's)")
    p.add_argument(
        "--warmup", type=int, default=LEADERBOARD_CASE.warmup_ms, help="do_bench warm-up, ms (the course's)"
    )
    p.add_argument("--dkdv", help="force this dK/dV config (its str), e.g. the split q64-k64-w4-s2-tma-gluon")
    p.add_argument("--json", type=Path, help="write the rows here")
    a = p.parse_args(argv)
    check_outputs(p, {"--json": (a.json, False)})
    import torch

    from cs336_systems.kernels import flash

    rows = []
    with _forced(a.dkdv):
        for impl in a.impls.split(","):
            rows.append(time_case(impl, a.rep, a.warmup))
            print(json.dumps(rows[-1], default=str), flush=True)
    ours = [r["mean_ms"] for r in rows if r["impl"] == "ours"]
    cudnn = [r["mean_ms"] for r in rows if r["impl"] == "cudnn"]
    summary = {"gpu": torch.cuda.get_device_name(), "dkdv_forced": a.dkdv, "tuning": flash.tuning_report()}
    if ours and cudnn:
        summary["ours_over_cudnn"] = statistics.mean(ours) / statistics.mean(cudnn)
        print(f"ours {statistics.mean(ours):.3f} ms, cuDNN {statistics.mean(cudnn):.3f} ms: "
              f"{summary['ours_over_cudnn']:.3f}x (do_bench mean, rep={a.rep}, warmup={a.warmup})")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"rows": rows, **summary}, indent=1, default=str))


if __name__ == "__main__":
    main()
