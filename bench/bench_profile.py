"""D3 (nsys_profile (a)-(e)) as bench cases: a torch.profiler kernel summary of one training step,
attributed to the NVTX/profiler ranges forward / loss / backward / optimizer step and, inside the eager
reference attention, attention scores / softmax / final matmul.

Each case times the training step like the D2 cases (2 warm-up, 5 timed steps here: the timing is for
the D3 (a) comparison, the D2 figures come from bench_model.py), then profiles one more step and
stores the answers in extra_info: ``forward_kernel_ms`` vs the timing, the top kernel of the forward and
of forward+backward with calls per step, the largest non-matmul kernels, ``matmul_share_forward`` vs
``matmul_share_step``, and ``attn_softmax_ms`` vs ``attn_scores_ms`` / ``attn_final_matmul_ms`` next to
their FLOPs. Kernel names longer than 40 characters are kept as extra_info strings (not table keys).

Grid: Table 1 sizes × ctx {128, 256, 512, 1024}, fp32 eager, pytorch attention (the handout's setup);
small and medium at ctx 256 are the default (the rest ``slow``). CPU: tiny, aten ops instead of kernels.

    pytest bench/bench_profile.py --only size=small,medium --only ctx=256      # ~1 min on an H100
"""

from __future__ import annotations

import itertools

import pytest
import torch

from cs336_systems.harness.model_case import benchmark_model_case
from cs336_systems.model import TABLE1_SIZES
from cs336_systems.profiling.flops import forward_flops
from cs336_systems.profiling.profiler import profile_step
from cs336_systems.profiling.workload import Case, Workload
from cs336_systems.rows.schema import tag

ON_GPU = torch.cuda.is_available()


def _cases() -> list:
    names = ("size", "ctx", "dtype", "mode")
    cases = [pytest.param("tiny", 32, "fp32", "train", id="tiny-ctx32-fp32-train")]
    for size, ctx in itertools.product(TABLE1_SIZES, (128, 256, 512, 1024)):
        marks = [pytest.mark.gpu]
        if (size, ctx) not in {("small", 256), ("medium", 256)}:
            marks.append(pytest.mark.slow)
        cases.append(pytest.param(size, ctx, "fp32", "train", marks=marks, id=f"{size}-ctx{ctx}-fp32-train"))
    return [names, cases]


def _d3(workload: Workload) -> dict:
    case = workload.case
    summary = profile_step(workload.step, workload.device, steps=1, warmup=0)
    answers = summary.d3_answers(forward_flops(case.config, case.batch, case.ctx))
    answers["forward_top_other_kernels"] = "; ".join(answers["forward_top_other_kernels"])
    return answers


@pytest.mark.parametrize(*_cases())
def test_profile(benchmark, device, matmul_tflops, size, ctx, dtype, mode) -> None:
    case = Case(size, ctx, mode, dtype)
    tag(benchmark, "profile")
    warmup, rounds = (2, 5) if ON_GPU else (1, 2)
    rate = matmul_tflops(case.torch_dtype)
    info = benchmark_model_case(
        benchmark, case, device, warmup=warmup, rounds=rounds, peak_tflops=rate, after=_d3
    )
    if info["oom"]:
        return
    assert info["forward_top_kernel_calls"] >= 1
    assert 0 < info["matmul_share_forward"] <= 1
    assert info["attn_softmax_ms"] > 0
