"""Timing one model case (``profiling.workload``) into pytest-benchmark: build, warm up, time, derive
throughput / MFU / memory, run the extra passes (profiler, snapshot), free; OOM becomes a row.
Used by ``bench/bench_model.py``, ``bench/bench_profile.py`` and the CLI (with a ``Recorder``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from cs336_systems.harness.environment import device_name, environment_info
from cs336_systems.harness.record import record_oom, run_benchmark
from cs336_systems.profiling.flops import mfu_both
from cs336_systems.profiling.memory import free_device_memory
from cs336_systems.profiling.timing import is_oom
from cs336_systems.profiling.workload import Case, Workload
from cs336_systems.units import MIB


def benchmark_model_case(
    benchmark: Any,
    case: Case,
    device: torch.device,
    *,
    warmup: int = 5,
    rounds: int = 10,
    peak_tflops: float | None = None,
    compile_backend: str = "inductor",
    after: Callable[[Workload], dict[str, Any] | None] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """Build the case, time ``rounds`` steps after ``warmup`` (``run_benchmark``), fill extra_info with
    timing, throughput, MFU and memory, run ``after(workload)`` (profiling, snapshots) and free
    everything. Out-of-memory, in the build or in a step, becomes an OOM row. Returns extra_info.
    ``progress`` is ``run_benchmark``'s callback."""
    info = {**case.info(), **environment_info(device)}
    if peak_tflops is not None:
        info["matmul_tflops"] = peak_tflops
    benchmark.extra_info.update(warmup=warmup, rounds=rounds)
    try:
        workload = Workload(case, device, compile_backend=compile_backend)
    except Exception as exc:
        if not is_oom(exc):
            raise
        record_oom(benchmark, **info)  # frees device memory itself
        return benchmark.extra_info
    try:
        info["params"] = sum(p.numel() for p in workload.model.parameters())
        times = run_benchmark(
            benchmark, workload.step, device, warmup=warmup, rounds=rounds, progress=progress, **info
        )
        if times is not None:
            # first/max: the warm-up study's cold-start signal (with 0 warm-ups the first step pays)
            benchmark.extra_info.update(first_ms=times[0], max_ms=max(times))
            benchmark.extra_info.update(_derived(benchmark.extra_info, case, device, peak_tflops))
            if after is not None:
                benchmark.extra_info.update(_guarded(after, workload))
    finally:
        workload.close()
        del workload
        free_device_memory()
    return benchmark.extra_info


def _guarded(after: Callable[[Workload], dict[str, Any] | None], workload: Workload) -> dict[str, Any]:
    # The timing is already recorded; an extra pass (profiler, snapshot) that runs out of memory only
    # marks the row instead of turning it into an OOM row.
    try:
        return after(workload) or {}
    except Exception as exc:
        if not is_oom(exc):
            raise
        return {"after_oom": True}


def _derived(info: dict[str, Any], case: Case, device: torch.device, peak_tflops: float | None) -> dict:
    seconds = info["mean_ms"] / 1e3
    out: dict[str, Any] = {
        "tokens_per_s": case.batch * case.ctx / seconds,
        "tflops": case.flops / seconds / 1e12,
    }
    if device.type == "cuda":  # a CPU has no dense bf16 peak to speak of
        both = mfu_both(case.flops / seconds, (peak_tflops or 0) * 1e12, device_name(device))
        out.update({k: v for k, v in both.items() if k in ("mfu", "mfu_peak", "peak_tflops")})
    elif peak_tflops:
        out["mfu"] = case.flops / seconds / (peak_tflops * 1e12)
    if device.type == "cuda":
        out["memory_after_mib"] = torch.cuda.memory_allocated(device) / MIB  # params (+grads, state)
    return out
