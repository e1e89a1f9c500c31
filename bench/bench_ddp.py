"""D14-D17 DDP: time per training step and time communicating, for every DDP variant side by side
with torch's ``DistributedDataParallel`` at the same bucket sizes.

Setup (handout 2.2-2.3, "1 node x 2 GPUs, XL"): the xl preset, context 512, global batch 4 (2 per
rank), fp32 parameters, torch.optim.AdamW, nccl; on a CPU-only machine the tiny preset on gloo
(context 32, a few steps) so the bench runs in seconds. Variants: ``local`` (the same per-rank step
with no communication: the floor), ``naive`` (D14, one all-reduce per gradient after backward),
``flat`` (D15, one flattened all-reduce), ``individual`` (D16, async per-gradient all-reduce from
hooks), ``bucketed`` (D17, bucket_mb 1/10/100/1000) and ``torch_ddp`` (bucket_cap_mb 1/10/100/1000); with
``--adapters PATH`` also ``adapters``: that file's DDP hooks (per parameter, then bucketed at each size).

Numbers (``cs336_systems.harness.train_step``): the step time is the host clock around one full
step ending in a device synchronize, max over ranks per step; pytest-benchmark's rounds and
``extra_info`` ``mean_ms`` / ``std_ms`` / ``median_ms`` are those steps (``warmup_steps`` untimed before).
``comm_ms``: time after backward waiting for gradient communication (all of it for naive/flat, the
exposed part for the overlapping wrappers; None for torch DDP, which waits inside backward), and
``comm_share`` = comm_ms / step. ``overhead_ms`` = step - the ``local`` step. On GPUs one extra
profiled step gives ``overlap_share`` (share of NCCL kernel time concurrent with compute kernels),
``comm_kernel_ms`` and ``compute_kernel_ms``; rank 0's Chrome traces of the naive and individual cases (the handout's two
screenshots; CS336_TRACE_VARIANTS to change) land in ``CS336_TRACE_DIR`` (default runs/traces, git-ignored:
1.5 MB each, too large for docs/results; open in https://ui.perfetto.dev).

All cases of one (size, ctx, dtype, world_size) run in one spawn. Environment overrides: CS336_DDP_SIZE
(comma list of presets), CS336_DDP_CTX, CS336_DDP_BATCH (global), CS336_DDP_WARMUP, CS336_DDP_STEPS,
CS336_DDP_PROFILE_STEPS, CS336_DDP_WORLD_SIZES (default 2), CS336_DDP_DTYPES (fp32; bf16 = autocast).

    pytest bench/bench_ddp.py --benchmark-json=ddp.json            # 2 GPUs: ~4 min
    pytest bench/bench_ddp.py --only variant=bucketed,torch_ddp --only bucket_mb=100
"""

from __future__ import annotations

import statistics

import pytest
import torch

from cs336_systems.harness.adapters import IMPL, row_marks, timed, workload
from cs336_systems.harness.distributed import (
    GroupedRuns,
    run_train_case,
    train_runs,
)
from cs336_systems.harness.record import record_oom, record_times
from cs336_systems.harness.settings import settings
from cs336_systems.harness.train_step import TrainCase

SPAWN_TIMEOUT_S = 1500.0
ADAPTERS_INDIVIDUAL = ("get_ddp_individual_parameters|get_ddp",)
ADAPTERS_BUCKETED = (
    "get_ddp_bucketed",
    "ddp_bucketed_on_after_backward",
    "ddp_bucketed_on_train_batch_start",
)
BUCKETS_MB = (1, 10, 100, 1000)
VARIANTS: list[tuple[str, int | None]] = [
    ("local", None),
    ("naive", None),
    ("flat", None),
    ("individual", None),
    *(("bucketed", b) for b in BUCKETS_MB),
    *(("torch_ddp", b) for b in BUCKETS_MB),
]
CTX = settings().ddp_ctx
CASES = [
    pytest.param(
        size,
        CTX,
        dtype,
        int(ws),
        variant,
        bucket,
        id=f"{size}-ctx{CTX}-{dtype}-ws{ws}-{variant}" + (f"-{bucket}MB" if bucket else ""),
    )
    for size in settings().ddp_size
    for dtype in settings().ddp_dtypes
    for ws in settings().ddp_world_sizes
    for variant, bucket in VARIANTS
]


def case_of(variant: str, bucket_mb: int | None) -> TrainCase:
    return TrainCase(variant, bucket_mb)


@pytest.fixture(scope="module")
def ddp_runs(request: pytest.FixtureRequest) -> GroupedRuns:
    return train_runs(request, lambda p: case_of(p["variant"], p["bucket_mb"]), SPAWN_TIMEOUT_S)


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 300)
@pytest.mark.parametrize("size,ctx,dtype,world_size,variant,bucket_mb", CASES)
def test_ddp_step(
    benchmark,
    ddp_runs,
    size: str,
    ctx: int,
    dtype: str,
    world_size: int,
    variant: str,
    bucket_mb: int | None,
) -> None:
    case = case_of(variant, bucket_mb)
    result, info = run_train_case(benchmark, ddp_runs, "ddp", case, size, ctx, dtype, world_size)
    group = (size, ctx, dtype, world_size)
    info.update(variant=variant, bucket_mb=bucket_mb, optimizer="adamw")
    if result["oom"]:
        record_oom(benchmark, **info)
        return
    local = ddp_runs.get(group, TrainCase("local"))
    if local is not None and not local["oom"] and variant != "local":
        info["overhead_ms"] = result["mean_ms"] - local["mean_ms"]
    record_times(benchmark, result["times_ms"], **info)
    assert result["mean_ms"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
@pytest.mark.parametrize(
    "world_size", [int(ws) for ws in settings().ddp_world_sizes], ids=lambda ws: f"ws{ws}"
)
@pytest.mark.parametrize(
    "bucket_mb",
    [
        pytest.param(None, id="adapters", marks=row_marks(IMPL, *ADAPTERS_INDIVIDUAL)),
        *(
            pytest.param(b, id=f"adapters-{b}MB", marks=row_marks(IMPL, *ADAPTERS_BUCKETED))
            for b in BUCKETS_MB
        ),
    ],
)
def test_adapters_ddp_step(
    benchmark, pytestconfig: pytest.Config, world_size: int, bucket_mb: int | None
) -> None:
    """The adapters' DDP (per parameter, or bucketed at each size) in ranks of its own code, beside
    torch's DDP on the same workload in the same ranks (``harness.adapters.workload``)."""
    on_gpu = torch.cuda.device_count() >= world_size
    args = {
        **workload(on_gpu),
        "bucket_mb": bucket_mb,
        "warmup": 3,
        "steps": 10,
        "backend": "nccl" if on_gpu else "gloo",
    }
    result = timed(pytestconfig, "ddp", args, world_size, args["backend"])
    torch_ms = statistics.fmean(result["torch_ddp_ms"])
    record_times(
        benchmark,
        result["adapters_ms"],
        deliverable="D17" if bucket_mb else "D16",
        variant=IMPL,
        bucket_mb=bucket_mb,
        world_size=world_size,
        workload=f"MLP {args['layers']} x ({args['d_model']} -> 4d -> d), batch {args['batch']}",
        num_params=result["params"],
        torch_ddp_same_workload_ms=torch_ms,
        ratio_vs_torch_ddp=statistics.fmean(result["adapters_ms"]) / torch_ms,
    )
