"""D20 optimizer state sharding: memory at the handout's three points and time per training step,
for AdamW unsharded, our ``ShardedOptimizer`` over AdamW, and torch's ``ZeroRedundancyOptimizer``.

Setup as the DDP bench (``bench_ddp.py``): xl, context 512, global batch 4 (2 per rank), fp32, 2 GPUs
on nccl (tiny on gloo on a CPU-only machine); gradients averaged by our ``DDPBucketed`` (100 MB
buckets) in every case, so only the optimizer differs. Variants: ``unsharded`` (torch.optim.AdamW),
``sharded`` (ShardedOptimizer(params, torch.optim.AdamW)), ``torch_zero``; with ``--adapters PATH`` also
``adapters``: that file's ``get_sharded_optimizer(params, torch.optim.AdamW)``, in ranks of its own code
beside ZeroRedundancyOptimizer and AdamW on one workload (``harness.adapters.workload``).

extra_info (max over ranks): ``peak_after_init_mib`` (torch.cuda.max_memory_allocated after building
model, DDP wrapper and optimizer), ``peak_before_step_mib`` / ``peak_after_step_mib`` (peak within one
steady-state step after the warm-up, optimizer state present, up to right before / right after
``optimizer.step()``) and ``mem_*_mib`` (allocated at the same points); the breakdown
``params_mib`` / ``grads_mib`` (from the model), ``optim_state_mib`` (bytes of the state tensors this rank holds, measured),
``optim_state_full_mib`` (2 fp32 moments per parameter: what unsharded AdamW holds) and
``optim_state_share`` = optim_state_mib / optim_state_full_mib (goal <= 0.55 on 2 ranks).
Step time as in the DDP bench (max over ranks per step; ``mean_ms`` etc.); ``step_ratio`` =
mean / unsharded mean (goal <= 1.10). Memory figures are None on CPU.

    pytest bench/bench_sharding.py --benchmark-json=sharding.json    # 2 GPUs: ~1.5 min
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

SPAWN_TIMEOUT_S = 900.0
BUCKET_MB = 100
OPTIMIZER_OF = {"unsharded": "adamw", "sharded": "sharded", "torch_zero": "zero"}
CTX = settings().ddp_ctx
CASES = [
    pytest.param(
        size,
        CTX,
        dtype,
        int(ws),
        variant,
        id=f"{size}-ctx{CTX}-{dtype}-ws{ws}-{variant}",
    )
    for size in settings().ddp_size
    for dtype in settings().ddp_dtypes
    for ws in settings().ddp_world_sizes
    for variant in OPTIMIZER_OF
]


def case_of(variant: str) -> TrainCase:
    return TrainCase("bucketed", BUCKET_MB, OPTIMIZER_OF[variant])


@pytest.fixture(scope="module")
def sharding_runs(request: pytest.FixtureRequest) -> GroupedRuns:
    # The optimizer step is what differs; no profiled step needed here.
    return train_runs(request, lambda p: case_of(p["variant"]), SPAWN_TIMEOUT_S, profile_steps=0)


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 300)
@pytest.mark.parametrize("size,ctx,dtype,world_size,variant", CASES)
def test_sharding_step(
    benchmark,
    sharding_runs,
    size: str,
    ctx: int,
    dtype: str,
    world_size: int,
    variant: str,
) -> None:
    case = case_of(variant)
    result, info = run_train_case(benchmark, sharding_runs, "sharding", case, size, ctx, dtype, world_size)
    group = (size, ctx, dtype, world_size)
    info.update(variant=variant, optimizer=OPTIMIZER_OF[variant], ddp="bucketed", bucket_mb=BUCKET_MB)
    if result["oom"]:
        record_oom(benchmark, **info)
        return
    full = 2 * result["params_mib"]  # AdamW: exp_avg and exp_avg_sq, fp32 like the parameters
    info.update(optim_state_full_mib=full, optim_state_share=result["optim_state_mib"] / full)
    baseline = sharding_runs.get(group, case_of("unsharded"))
    if baseline is not None and not baseline["oom"]:
        info["step_ratio"] = result["mean_ms"] / baseline["mean_ms"]
    record_times(benchmark, result["times_ms"], **info)
    assert result["optim_state_mib"] > 0


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S)
@pytest.mark.parametrize(
    "world_size", [int(ws) for ws in settings().ddp_world_sizes], ids=lambda ws: f"ws{ws}"
)
@pytest.mark.parametrize("variant", [pytest.param(IMPL, marks=row_marks(IMPL, "get_sharded_optimizer"))])
def test_adapters_sharding_step(
    benchmark, pytestconfig: pytest.Config, world_size: int, variant: str
) -> None:
    """The adapters' sharded AdamW step in ranks of its own code, beside torch's ZeRO and AdamW."""
    on_gpu = torch.cuda.device_count() >= world_size
    args = {**workload(on_gpu), "warmup": 3, "steps": 10, "backend": "nccl" if on_gpu else "gloo"}
    result = timed(pytestconfig, "sharded", args, world_size, args["backend"])
    unsharded = statistics.fmean(result["unsharded_ms"])
    record_times(
        benchmark,
        result["adapters_ms"],
        deliverable="D20",
        variant=IMPL,
        world_size=world_size,
        workload=f"MLP {args['layers']} x ({args['d_model']} -> 4d -> d)",
        num_params=result["params"],
        torch_zero_same_workload_ms=statistics.fmean(result["torch_zero_ms"]),
        unsharded_same_workload_ms=unsharded,
        step_ratio=statistics.fmean(result["adapters_ms"]) / unsharded,
        optim_state_mib=result["adapters_state_mib"],
        optim_state_share=result["adapters_state_mib"] / result["unsharded_state_mib"],
    )
