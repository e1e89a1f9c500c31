"""A miniature bench suite for the report tests: real pytest-benchmark cases, recorded through the
suite's own ``run_benchmark`` / ``record_oom`` / ``record_not_run``, grouped through the schema
(``schema.tag``) like the real benches (bench/*.py), with their parameter names and extra_info keys, but tiny CPU work so that a session takes a second or two.

Not collected by the normal test run (the file name does not match ``test_*`` / ``bench_*``); the
report tests run it in a subprocess with ``--benchmark-json``. ``SAMPLE_WORK`` scales the work per
step (the regression-gate test makes a second run slower on purpose).
"""

from __future__ import annotations

import os

import pytest
import torch

from cs336_systems.harness.record import record_not_run, record_oom, run_benchmark
from cs336_systems.profiling.timing import time_steps
from cs336_systems.rows.schema import tag

CPU = torch.device("cpu")
WORK = int(os.environ.get("SAMPLE_WORK", "1"))
torch.set_num_threads(1)  # a loaded 2-core CI box makes intra-op threads spin for milliseconds


def _matmul_step(n: int):
    a = torch.randn(n, n)

    def step() -> None:
        a @ a
        sum(range(WORK * 1000))  # plain CPU work that SAMPLE_WORK scales linearly

    return step


@pytest.mark.parametrize("mode", ["fwd", "train"])
@pytest.mark.parametrize("ctx", [16, 32])
@pytest.mark.parametrize("size", ["tiny"])
def test_model(benchmark, size: str, ctx: int, mode: str) -> None:
    tag(benchmark, "model", size)
    n = ctx * (3 if mode == "train" else 1)
    run_benchmark(
        benchmark,
        _matmul_step(n),
        CPU,
        warmup=1,
        rounds=3,
        size=size,
        ctx=ctx,
        mode=mode,
        dtype="fp32",
        batch=4,
        tokens_per_s=4 * ctx * 1000.0,
        model_flops=2 * n**3,
        mfu=0.25,
        device_name="cpu",
    )


@pytest.mark.parametrize("warmup", [0, 2])
def test_warmup(benchmark, warmup: int) -> None:
    tag(benchmark, "warmup")
    run_benchmark(benchmark, _matmul_step(32), CPU, warmup=warmup, rounds=3, device_name="cpu")


@pytest.mark.parametrize("seq", [64, 128, 4096])
@pytest.mark.parametrize("d", [16])
@pytest.mark.parametrize("impl", ["pytorch", "pytorch_compiled"])
def test_attention(benchmark, impl: str, d: int, seq: int) -> None:
    tag(benchmark, "attention")
    if seq == 4096:  # stands in for a case that runs out of device memory
        record_oom(benchmark, impl=impl, d=d, seq=seq, device_name="cpu")
        return
    q = torch.randn(8, seq, d)
    fwd = time_steps(lambda: torch.softmax(q @ q.transpose(1, 2), -1) @ q, 1, 3, CPU)
    run_benchmark(
        benchmark,
        _matmul_step(seq),
        CPU,
        warmup=1,
        rounds=3,
        fwd_ms=sum(fwd) / 3,
        bwd_ms=2 * sum(fwd) / 3,
        mem_before_bwd_mib=(8 * seq * seq * 4 + 5 * 8 * seq * d * 4) / 2**20,  # P + q, k, v, O, dO
        saved_for_bwd_mib=(8 * seq * seq * 4 + 8 * seq * d * 4) / 2**20,  # P + O: what the forward added
        device_name="cpu",
    )


@pytest.mark.parametrize("pass_", ["fwd", "fwd_bwd"])
@pytest.mark.parametrize("seq", [128, 256])
@pytest.mark.parametrize("d", [16, 32])
@pytest.mark.parametrize("dtype", ["bf16"])
@pytest.mark.parametrize("impl", ["pytorch", "triton"])
def test_flash(benchmark, impl: str, dtype: str, d: int, seq: int, pass_: str) -> None:
    tag(benchmark, "flash_sweep")
    if (impl, d, seq, pass_) == ("triton", 32, 256, "fwd"):  # a row that says why it did not run
        record_not_run(benchmark, "unsupported", "stand-in for a backend without this case")
        return
    times = run_benchmark(benchmark, _matmul_step(seq // 4), CPU, warmup=1, rounds=3, device_name="cpu")
    assert times is not None
    median = sorted(times)[1]
    benchmark.extra_info.update(do_bench_ms=median, tflops=4 * seq * seq * d / median / 1e9)


@pytest.mark.parametrize("nbytes", ["1MB", "10MB"])
@pytest.mark.parametrize("world_size", [2, 4])
@pytest.mark.parametrize("backend", ["gloo"])
def test_allreduce(benchmark, backend: str, world_size: int, nbytes: str) -> None:
    tag(benchmark, "allreduce")
    size = {"1MB": 2**20, "10MB": 10 * 2**20}[nbytes]  # MB means MiB (units.py)
    latency_s, bandwidth = 1e-4 * world_size, 1e9  # a synthetic cost model: t = o + n / w
    ms = (latency_s + size / bandwidth) * 1e3
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
    benchmark.extra_info.update(
        mean_ms=ms,
        std_ms=0.01 * ms,
        max_ms=1.1 * ms,
        algbw_gbps=size / (ms * 1e-3) / 1e9,
        busbw_gbps=size / (ms * 1e-3) / 1e9 * 2 * (world_size - 1) / world_size,
        bytes=size,
        oom=False,
        device_name="cpu",
    )


@pytest.mark.parametrize("variant", ["unsharded", "sharded"])
def test_sharding(benchmark, variant: str) -> None:
    tag(benchmark, "sharding")
    # The tiny preset has 1,411,392 parameters: 5.384 MiB in fp32, AdamW state twice that.
    params = 1_411_392 * 4 / 2**20
    optim = 2 * params if variant == "unsharded" else params
    run_benchmark(
        benchmark,
        _matmul_step(32),
        CPU,
        warmup=1,
        rounds=3,
        params_mib=params,
        grads_mib=params,
        optim_state_mib=optim,
        peak_after_init_mib=params,
        peak_before_step_mib=2 * params + optim,
        peak_after_step_mib=2 * params + optim + 1.0,
        size="tiny",
        world_size=2,
        device_name="cpu",
    )


# Deliberately outside the schema: the report must still show a group it does not know.
@pytest.mark.benchmark(group="misc group the report does not know")
@pytest.mark.parametrize("n", [8, 16])
def test_unknown(benchmark, n: int) -> None:
    benchmark(_matmul_step(n))
    benchmark.extra_info["answer"] = n * 2
