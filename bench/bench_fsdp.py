"""D23/D24(b) FSDP: our FSDP (``cs336_systems.distributed.fsdp``) side by side with torch's FSDP2
(``fully_shard``, ``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)``) at the same
unit granularity, and the suite's per-parameter overlapped DDP (``individual``).

Pairs (ours vs FSDP2, same units): ``fsdp_blocks`` / ``torch_fsdp2_blocks``, one unit per
Transformer block plus the embedding and the LM head (FSDP2: one ``fully_shard`` per block, the
embedding, the LM head and the root) -- **the headline pair**, the granularity FSDP is used at;
``fsdp`` / ``torch_fsdp2``, one unit per Linear/Embedding (the course's contract; 338 units at xl).

Setup: xl, context 512, global batch 4 (2 per rank), 2 GPUs, nccl, torch.optim.AdamW, fp32 and bf16.
bf16 means: FSDP variants cast the weights to bf16 before the all-gather (fp32 masters, fp32
reduce); DDP runs under bf16 autocast (fp32 parameters). On a CPU-only machine the tiny preset on
gloo (context 32, a few steps).

Per case (``extra_info``, the training harness ``cs336_systems.harness.train_step``): step time
(``mean_ms``; pytest-benchmark rounds are the steps), ``peak_memory_mib`` per rank, this rank's
``params_mib`` / ``grads_mib`` / ``optim_state_mib`` and their sum ``state_mib``; ``state_vs_ddp``
(``state_mib`` / DDP's) and ``time_vs_fsdp2`` (``mean_ms`` / FSDP2's at the same granularity), both measured in the same run;
from one profiled step (GPU), ``allgather_hidden_mean`` / ``allgather_hidden_min``: the share of
each all-gather kernel concurrent with compute kernels (D24(b); 1.0 = fully hidden); for ours,
``allgather_ready_share`` (share of unit forwards whose all-gather had finished when the compute
stream could start the unit; worst rank) and ``allgather_exposed_ms`` (per step, compute stream idle
waiting for a gather), from ``overlap.unit_readiness``.

    pytest bench/bench_fsdp.py --benchmark-json=$OUT/fsdp.json     # 2 GPUs: ~4 min
"""

from __future__ import annotations

import pytest

from cs336_systems.harness.distributed import (
    GroupedRuns,
    run_train_case,
    train_runs,
)
from cs336_systems.harness.record import record_oom, record_times
from cs336_systems.harness.settings import settings
from cs336_systems.harness.train_step import TrainCase

SPAWN_TIMEOUT_S = 600.0
VARIANTS = ("fsdp_blocks", "torch_fsdp2_blocks", "fsdp", "torch_fsdp2", "individual")
TORCH_PAIR = {"fsdp_blocks": "torch_fsdp2_blocks", "fsdp": "torch_fsdp2"}  # ours -> FSDP2, same units
WORLD_SIZE = 2
CASES = [
    pytest.param(size, settings().ddp_ctx, dtype, WORLD_SIZE, variant, id=f"{size}-{dtype}-{variant}")
    for size in settings().ddp_size
    for dtype in ("fp32", "bf16")
    for variant in VARIANTS
]


@pytest.fixture(scope="module")
def fsdp_runs(request: pytest.FixtureRequest) -> GroupedRuns:
    return train_runs(request, lambda p: TrainCase(p["variant"]), SPAWN_TIMEOUT_S)


def _state_mib(result: dict) -> float:
    return result["params_mib"] + result["grads_mib"] + result["optim_state_mib"]


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 300)
@pytest.mark.parametrize("size,ctx,dtype,world_size,variant", CASES)
def test_fsdp_step(
    benchmark, fsdp_runs, size: str, ctx: int, dtype: str, world_size: int, variant: str
) -> None:
    result, info = run_train_case(
        benchmark, fsdp_runs, "fsdp", TrainCase(variant), size, ctx, dtype, world_size
    )
    group = (size, ctx, dtype, world_size)
    info.update(variant=variant, optimizer="adamw", compute_dtype=dtype)
    if variant != "individual":
        info.update(param_dtype="fp32", autocast=None)
    if result["oom"]:
        record_oom(benchmark, **info)
        return
    info["state_mib"] = _state_mib(result)
    ddp = fsdp_runs.get(group, TrainCase("individual"))
    if ddp is not None and not ddp["oom"]:
        info["state_vs_ddp"] = info["state_mib"] / _state_mib(ddp)
    fsdp2 = fsdp_runs.get(group, TrainCase(TORCH_PAIR[variant])) if variant in TORCH_PAIR else None
    if fsdp2 is not None and not fsdp2["oom"]:
        info["time_vs_fsdp2"] = result["mean_ms"] / fsdp2["mean_ms"]
    record_times(benchmark, result["times_ms"], **info)
    assert result["mean_ms"] > 0
    if variant != "individual" and ddp is not None and not ddp["oom"]:
        assert info["state_vs_ddp"] < 0.75  # sharded: about half of DDP's on 2 ranks
