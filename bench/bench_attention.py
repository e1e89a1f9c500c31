"""D6 (pytorch_attention) and D7a (torch_compile (a)): plain PyTorch attention, eager vs compiled.

Grid (handout 1.2.1): batch 8, no head axis, d in {16, 32, 64, 128} x seq in {256, 1024, 4096, 8192,
16384}, fp32, causal (the LM's attention), ``impl`` in {"pytorch", "pytorch_compiled"} in ONE group so
the table compares them; with ``--adapters PATH`` also ``adapters``, that file's Triton FlashAttention
(GPU cases only). ``pytorch_compiled`` is ``torch.compile(dynamic=False)``, compiled once per
shape (compilation falls in the warm-up).

Protocol: 5 warm-up rounds, then 100 rounds of one forward pass and one backward pass, each followed by
a device synchronize (handout (f)): that is the 100 forward and 100 backward passes. Per-pass host-clock
times go to ``extra_info`` as ``fwd_ms``/``fwd_std_ms``/``bwd_ms``/``bwd_std_ms`` (mean / std over the
100). pytest-benchmark's own statistics time the whole round, i.e. ONE forward + backward PAIR
(two synchronizes included). ``mem_before_bwd_mib`` is ``torch.cuda.memory_allocated`` after the
forward and before the backward (inputs q, k, v and dO included; ``saved_for_bwd_mib`` is that minus
the memory allocated before the forward, i.e. output + what autograd saved). Out-of-memory is a
result row (``oom=True``, with ``oom_phase`` and the memory before backward if the forward ran).

On a CPU-only machine the cases seq 256, d in {16, 64} run with 5 passes (1 warm-up); the rest are
marked ``gpu`` and skipped with a reason.

Selection (bench/conftest.py ``--only``) and knobs::

    pytest bench/bench_attention.py --only impl=pytorch --only seq=1024,4096 --only d=64,128
    CS336_D6_PASSES=10 pytest bench/bench_attention.py      # quick smoke run (default 100 passes)
"""

from __future__ import annotations

import statistics
import timeit

import pytest
import torch

from cs336_systems.harness.adapters import IMPL, TRITON_HOOK, adapters_param, standing, timed
from cs336_systems.harness.attention import make_grad, make_qkv, resolve_impl
from cs336_systems.harness.environment import environment_info
from cs336_systems.harness.record import log_case, record_oom, record_times, run_benchmark
from cs336_systems.harness.settings import settings
from cs336_systems.profiling.memory import free_device_memory, memory_allocated_mib
from cs336_systems.profiling.timing import is_oom, synchronize
from cs336_systems.rows.schema import tag

D6_BATCH = 8
D6_DS = (16, 32, 64, 128)
D6_SEQS = (256, 1024, 4096, 8192, 16384)
D6_IMPLS = ("pytorch", "pytorch_compiled")
D6_DTYPE = "fp32"
D6_CAUSAL = True
CPU_SEQS, CPU_DS = (256,), (16, 64)
ON_GPU = torch.cuda.is_available()


def _cases() -> list:
    cases = []
    for d in D6_DS:
        for seq in D6_SEQS:
            for impl in D6_IMPLS:
                cpu_ok = seq in CPU_SEQS and d in CPU_DS
                marks = () if cpu_ok else (pytest.mark.gpu,)
                cases.append(pytest.param(impl, d, seq, D6_DTYPE, marks=marks, id=f"d{d}-seq{seq}-{impl}"))
            # --adapters PATH: that file's Triton FlashAttention (GPU only, as flash_triton in bench_flash)
            cases.append(
                adapters_param(
                    IMPL, d, seq, D6_DTYPE, hooks=(TRITON_HOOK,), id=f"d{d}-seq{seq}-{IMPL}", gpu=True
                )
            )
    return cases


@pytest.mark.parametrize(("impl", "d", "seq", "dtype"), _cases())
def test_attention_eager_vs_compiled(
    benchmark, device: torch.device, pytestconfig: pytest.Config, impl: str, d: int, seq: int, dtype: str
) -> None:
    tag(benchmark, "attention")
    passes = settings().d6_passes if device.type == "cuda" else 5
    warmup = 5 if device.type == "cuda" else 1
    info = dict(
        deliverable="D7a" if impl == "pytorch_compiled" else "D6",  # per row, finer than the group's "D6/D7a"
        impl=impl,
        d=d,
        seq=seq,
        batch=D6_BATCH,
        dtype=dtype,
        causal=D6_CAUSAL,
        passes=passes,
        warmup_rounds=warmup,
        **environment_info(device),
    )
    free_device_memory(device)  # 40 cases of up to GiBs each: start each from a clean pool
    if impl == IMPL:
        _adapters_row(benchmark, pytestconfig, info)
        return
    fwd_ms: list[float] = []
    bwd_ms: list[float] = []
    mem: dict[str, float | None] = {}
    phase = ["inputs"]
    try:
        fn = resolve_impl(impl, (D6_BATCH, seq, d, dtype))
        q, k, v = make_qkv(D6_BATCH, seq, d, dtype, device)
        dout = make_grad(q)

        def zero_grads() -> None:
            q.grad = k.grad = v.grad = None

        def fwd_then_bwd() -> None:
            phase[0] = "fwd"
            mem["before_fwd"] = memory_allocated_mib(device)
            start = timeit.default_timer()
            out = fn(q, k, v, D6_CAUSAL)
            synchronize(device)
            mid = timeit.default_timer()
            mem["before_bwd"] = memory_allocated_mib(device)
            phase[0] = "bwd"
            out.backward(dout)
            synchronize(device)
            end = timeit.default_timer()
            fwd_ms.append((mid - start) * 1e3)
            bwd_ms.append((end - mid) * 1e3)

        times = run_benchmark(
            benchmark, fwd_then_bwd, device, warmup=warmup, rounds=passes, setup=zero_grads, **info
        )
    except Exception as exc:
        if not is_oom(exc):
            raise
        # OOM while making inputs (run_benchmark turns OOM inside the passes into a row itself).
        record_oom(benchmark, **info)
        times = None
    finally:
        q = k = v = dout = None
    if times is None:
        benchmark.extra_info.update(
            status="oom", oom_phase=phase[0], mem_before_bwd_mib=mem.get("before_bwd")
        )
    else:
        benchmark.extra_info.update(
            status="ok",
            **_pass_stats(fwd_ms[-passes:], bwd_ms[-passes:]),
            mem_before_bwd_mib=mem["before_bwd"],
            saved_for_bwd_mib=(
                mem["before_bwd"] - mem["before_fwd"] if mem["before_bwd"] is not None else None
            ),
        )
    log_case(benchmark)


def _adapters_row(benchmark, config: pytest.Config, info: dict) -> None:
    """The adapters' Triton FlashAttention on this case, timed in a process of its own code."""
    args = {k: info[k] for k in ("batch", "seq", "d", "dtype", "causal", "passes")} | {
        "warmup": info["warmup_rounds"]
    }
    result = timed(config, "attention", args)
    if result.get("oom"):
        record_oom(benchmark, **info)
        benchmark.extra_info.update(
            status="oom", oom_phase=result["phase"], mem_before_bwd_mib=result["mem_before_bwd_mib"]
        )
    else:
        fwd, bwd = result["fwd_ms"], result["bwd_ms"]
        record_times(benchmark, [f + b for f, b in zip(fwd, bwd, strict=True)], **info)
        benchmark.extra_info.update(
            status="ok",
            **_pass_stats(fwd, bwd),
            mem_before_bwd_mib=result["mem_before_bwd_mib"],
            **standing(config, result, None),
        )
    log_case(benchmark)


def _pass_stats(fwd: list[float], bwd: list[float]) -> dict[str, float]:
    """Mean and standard deviation of the forward and backward passes' times."""
    spread = lambda xs: statistics.stdev(xs) if len(xs) > 1 else 0.0
    return dict(
        fwd_ms=statistics.fmean(fwd),
        fwd_std_ms=spread(fwd),
        bwd_ms=statistics.fmean(bwd),
        bwd_std_ms=spread(bwd),
    )
