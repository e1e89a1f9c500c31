"""The leaderboard ranks what the course ranks, phase by phase (CPU, stand-in observer reports).

The forward must be the repository's own Triton; the backward its own Triton or code compiled from
PyTorch (inductor's kernels and the matmuls they call: the handout's own design); no library attention in
either. Each design below is an observer's report as ncu would give it, split at the phase markers. The
rule fails with its backward loosened to "anything" (a SDPA backward would rank) and with the old rule
of 90% of the whole in the repository's kernels (the handout's design would not): both tried.
"""

from __future__ import annotations

import pytest

from cs336_systems.grading.repo.leaderboard import standing
from cs336_systems.grading.repo.leaderboard.observer import PHASE_MARKER, Observed, parse, phases

OWN = {"fwd_kernel", "bwd_dkdv_kernel", "bwd_dq_kernel"}
TRITON_BACKWARD = {"bwd_dkdv_kernel": 5.0, "bwd_dq_kernel": 3.0, "triton_poi_fused_mul_sum_0": 0.1}
COMPILED_BACKWARD = {  # damek's kind: inductor's kernels and cuBLAS's matmuls
    "sm80_xmma_gemm_f32f32_f32f32_f32_nn_n_tilesize128x128x8": 30.0,
    "triton_poi_fused_arange_div_exp_gt_masked_fill_1": 40.0,
    "triton_red_fused_mul_sum_0": 10.0,
    "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>": 0.5,
}


def _row(forward: dict[str, float], backward: dict[str, float], parent_ms: float | None = None) -> dict:
    seen = Observed.of_phases(forward, backward)
    total = sum(forward.values()) + sum(backward.values())
    evidence = standing.Evidence(
        course_failures=[],
        clock_problem=None,
        parent_ms=parent_ms or total * 1.1,
        course_ms=parent_ms or total * 1.1,
        floor_ms=0.001,
        observed=seen,
        observed_iterations=1,
        repo_kernels=OWN,
        phases=phases(seen, 1),
    )
    return standing.standing(evidence)


def test_a_triton_forward_and_backward_rank() -> None:
    row = _row({"fwd_kernel": 3.0}, TRITON_BACKWARD)
    assert row["ranked"], row["unranked_because"]
    assert row["forward"] == "own Triton 100%" and row["backward"] == "own Triton 99%", row


def test_the_handouts_design_ranks_its_backward_named_compiled_pytorch() -> None:
    row = _row({"fwd_kernel": 20.0}, COMPILED_BACKWARD)
    assert row["ranked"], row["unranked_because"]
    assert row["backward"] == "compiled PyTorch (inductor 62%, GEMMs 37%)", row["backward"]


@pytest.mark.parametrize(
    ("forward", "backward", "reason"),
    [
        (  # torch's SDPA recomputed for the backward
            {"fwd_kernel": 3.0},
            {"void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel": 6.0},
            "a library's attention ran in the backward: void pytorch_flash::flash_bwd",
        ),
        (  # the SDPA backward operator called directly: cuDNN's
            {"fwd_kernel": 3.0},
            {"cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma": 4.0},
            "a library's attention ran in the backward: cudnn_generated",
        ),
        (  # flex_attention compiled for the backward: inductor's template names the op
            {"fwd_kernel": 3.0},
            {"triton_tem_fused_flex_attention_backward_zeros_1": 5.0},
            "a library's attention ran in the backward: triton_tem_fused_flex_attention_backward",
        ),
        (  # a token kernel beside cuBLAS's matmuls in the forward
            {"fwd_kernel": 0.01, "sm90_xmma_gemm_bf16bf16_bf16f32": 3.0, "softmax_warp_forward": 1.0},
            TRITON_BACKWARD,
            "the forward: 0% of its GPU time is in its own Triton kernels (a rank needs 90%)",
        ),
        (  # a backward in eager PyTorch: aten's kernels, nothing compiled
            {"fwd_kernel": 3.0},
            {
                "void at::native::elementwise_kernel<128, 2>": 6.0,
                "void at::native::reduce_kernel<512, 1>": 3.0,
            },
            "the backward: 0% of its GPU time is in its own Triton kernels or code compiled from PyTorch",
        ),
    ],
)
def test_each_borrowed_design_gets_no_rank_naming_the_phase(forward, backward, reason) -> None:
    row = _row(forward, backward)
    assert not row["ranked"] and reason in row["unranked_because"], row["unranked_because"]


@pytest.mark.parametrize(("own", "ranked"), [(0.89, False), (0.91, True)])
def test_each_phase_needs_90_percent_in_what_it_may_run(own: float, ranked: bool) -> None:
    aside = {"void at::native::elementwise_kernel<128, 2>": 1.0 - own}
    forward = _row({"fwd_kernel": own, **aside}, TRITON_BACKWARD)
    backward = _row({"fwd_kernel": 3.0}, {"bwd_dq_kernel": own, **aside})
    assert forward["ranked"] == ranked and backward["ranked"] == ranked, (forward, backward)


def test_phases_that_cannot_be_told_apart_do_not_rank() -> None:
    seen = Observed.of_phases({"fwd_kernel": 3.0}, TRITON_BACKWARD)
    seen.sequence.insert(2, (PHASE_MARKER, 0.001))  # a marker the graded code launched itself
    split = phases(seen, 1)
    assert split == "3 phase markers for 1 observed calls (2 each)"
    row = standing.standing(standing.Evidence([], None, 10.0, 10.0, 0.001, seen, 1, OWN, phases=split))
    assert not row["ranked"] and "could not be told apart: 3 phase markers" in row["unranked_because"]


NCU = """==PROF== Connected to process 77 (/usr/bin/python3)
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"2","77","python3","h","fwd_kernel","1","7","(128, 1, 1)","(256, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","2.5"
"0","77","python3","h","at::cuda::spin_kernel(long)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","2"
"1","77","python3","h","void at::native::reduce_kernel<512, 1>(int)","1","7","(512, 1, 1)","(16, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","10"
"3","77","python3","h","at::cuda::spin_kernel(long)","1","7","(1, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","2"
"4","77","python3","h","bwd_dq_kernel","1","7","(128, 1, 1)","(256, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","5"
"""


def test_the_observers_launches_split_at_the_markers_in_launch_order() -> None:
    split = phases(parse(NCU), 1)
    assert split.forward == pytest.approx(
        {"void at::native::reduce_kernel<512, 1>(int)": 0.01, "fwd_kernel": 2.5}
    )
    assert split.backward == pytest.approx({"bwd_dq_kernel": 5.0})
