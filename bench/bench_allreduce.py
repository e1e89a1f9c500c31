"""D13 all-reduce: {gloo + CPU, nccl + GPU} x {1MB, 10MB, 100MB, 1GB} float32 x {2, 4, 6} processes.

Method (``cs336_systems.distributed.allreduce``): 5 warm-up calls, then timed calls with the ranks
lined up before each (synchronize + barrier); CUDA events for nccl, host clock for gloo. The step
time of a case is the per-call max over ranks: pytest-benchmark's rounds and ``extra_info``'s
``mean_ms`` / ``std_ms`` / ``median_ms`` / ``max_ms`` are those; ``rank_mean_ms`` is the mean over all
ranks and calls; ``algbw_gbps`` / ``busbw_gbps`` follow nccl-tests (busbw = algbw * 2(n-1)/n).
Sizes are MiB / GiB (``bytes`` in extra_info). One spawn per (backend, world size) runs all its sizes.

Skips: nccl cases needing more GPUs than present; gloo cases above ``CS336_GLOO_MAX_MB`` (default 10,
so a CPU-only dev machine stays fast; set ``CS336_GLOO_MAX_MB=1024`` for the full gloo table).

    pytest bench/bench_allreduce.py --benchmark-json=allreduce.json                   # everything present
    CS336_GLOO_MAX_MB=1024 pytest bench/bench_allreduce.py --only backend=gloo          # full gloo table
    pytest bench/bench_allreduce.py --only backend=nccl --only world_size=2,4
"""

from __future__ import annotations

import pytest

from cs336_systems.distributed.allreduce import SIZES, allreduce_sweep
from cs336_systems.distributed.launch import spawn
from cs336_systems.harness.distributed import GroupedRuns, backend_device_name, cuda_count, selected_params
from cs336_systems.harness.record import record_times
from cs336_systems.harness.settings import settings
from cs336_systems.rows.schema import tag

BACKENDS = ("gloo", "nccl")
WORLD_SIZES = (2, 4, 6)
GLOO_MAX_MB = settings().gloo_max_mb
SPAWN_TIMEOUT_S = 600.0


def skip_reason(backend: str, world_size: int, nbytes: str) -> str | None:
    if backend == "nccl" and cuda_count() < world_size:
        return f"nccl with {world_size} ranks needs {world_size} GPUs; {cuda_count()} present"
    if backend == "gloo" and SIZES[nbytes] > GLOO_MAX_MB * 2**20:
        return f"gloo above CS336_GLOO_MAX_MB={GLOO_MAX_MB:g}; set CS336_GLOO_MAX_MB=1024 for the full table"
    return None


CASES = [
    pytest.param(backend, world_size, nbytes, id=f"{backend}-ws{world_size}-{nbytes}")
    for backend in BACKENDS
    for world_size in WORLD_SIZES
    for nbytes in SIZES
]


@pytest.fixture(scope="module")
def allreduce_runs(request: pytest.FixtureRequest) -> GroupedRuns:
    selected = [
        p for p in selected_params(request) if skip_reason(p["backend"], p["world_size"], p["nbytes"]) is None
    ]

    def cases_of(group: tuple[str, int]) -> list[str]:
        return [p["nbytes"] for p in selected if (p["backend"], p["world_size"]) == group]

    def launch(group: tuple[str, int], names: list[str]) -> dict[str, dict]:
        backend, world_size = group
        sizes = [SIZES[n] for n in names]
        per_rank = spawn(allreduce_sweep, world_size, sizes, backend=backend, timeout=SPAWN_TIMEOUT_S)
        return {name: per_rank[0][SIZES[name]] for name in names}

    return GroupedRuns(launch, cases_of)


@pytest.mark.distributed
@pytest.mark.timeout(SPAWN_TIMEOUT_S + 120)
@pytest.mark.parametrize("backend,world_size,nbytes", CASES)
def test_allreduce(benchmark, allreduce_runs, backend: str, world_size: int, nbytes: str) -> None:
    tag(benchmark, "allreduce")
    reason = skip_reason(backend, world_size, nbytes)
    if reason:
        pytest.skip(reason)
    result = dict(allreduce_runs((backend, world_size), nbytes))
    times = result.pop("times_ms")
    record_times(
        benchmark,
        times,
        **result,
        bytes=SIZES[nbytes],
        device_name=backend_device_name(backend),
        oom=False,
    )
    assert result["busbw_gbps"] > 0
