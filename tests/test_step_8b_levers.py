"""The 8B step's levers of issue 50 on a scaled-down model (CPU, gloo): the optimizer inside the
backward, attention's output kept by selective checkpointing under the suite's FSDP, keep:auto's plan
against its budget, the course's timing protocol and cold-start verdict, MFU both ways."""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from cs336_systems.accounting import checkpointing as acc
from cs336_systems.distributed.fsdp_units import in_backward
from cs336_systems.harness.step_8b import combine_step_results
from cs336_systems.training import course_timing as ct
from cs336_systems.training.options import (
    FLOP_FORMULA,
    StepOptions,
    keep_budget_bytes,
    optimizer_in_backward_plan,
    predicted_step_memory,
    step_checkpoint_policy,
)
from cs336_systems.training.step_8b import run_step
from cs336_systems.units import GIB

SMALL = dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=64, context_length=16)


def small_options(**changes) -> StepOptions:
    base = dict(
        preset="tiny",
        model_changes=SMALL,
        compute_dtype="fp32",
        warmup=0,
        steps=1,
        lr=1e-3,
        return_params=True,
        attention="sdpa",
        loss="chunked",
        optimizer="torch_fused",
    )
    return StepOptions(**(base | changes))


# -- optimizer in backward through the 8B step -------------------------------------------------------


def _both_ways(options: StepOptions) -> list[dict]:
    return [run_step(dataclasses.replace(options, optimizer_in_backward=on)) for on in (False, True)]


@pytest.mark.distributed
@pytest.mark.timeout(120)
@pytest.mark.parametrize("compute_dtype", ["fp32", "bf16"])
def test_step_with_optimizer_in_backward_equals_the_plain_step(run_distributed, compute_dtype: str) -> None:
    """2 steps of the step driver (ours FSDP with block units, per-block checkpointing, fp32 masters)
    on 2 gloo ranks: the same losses and bitwise the same parameters."""
    options = small_options(compute_dtype=compute_dtype)
    per_rank = run_distributed(_both_ways, 2, options, backend="gloo", timeout=90)
    for plain, inside in per_rank:
        assert (plain["optimizer_in_backward"], inside["optimizer_in_backward"]) == (False, True)
        assert plain["losses"] == inside["losses"]
        for name, value in plain["params"].items():
            assert torch.equal(inside["params"][name], value), name


def test_clipping_or_another_fsdp_falls_back_to_the_plain_step() -> None:
    on, why = optimizer_in_backward_plan(StepOptions(optimizer_in_backward=True))
    assert on and why.startswith("on")
    clipped, why = optimizer_in_backward_plan(StepOptions(optimizer_in_backward=True, grad_clip=1.0))
    assert not clipped and "grad_clip=1" in why and "plain step" in why
    fsdp2, why = optimizer_in_backward_plan(StepOptions(optimizer_in_backward=True, fsdp="torch"))
    assert not fsdp2 and "fsdp='torch'" in why
    result = run_step(small_options(fsdp="none", optimizer_in_backward=True, grad_clip=0.5, steps=0))
    assert result["optimizer_in_backward"] is False and "plain step" in result["optimizer_in_backward_note"]


# -- attention's output kept: no attention forward in the backward -----------------------------------


def _attention_grads(save_attention: bool) -> dict:
    """One forward and backward of the small model through ours FSDP, every block checkpointed;
    counts FlashAttention's forward calls outside and inside the backward."""
    from cs336_systems.kernels import flash
    from cs336_systems.training.sharding import shard_model
    from cs336_systems.training.step_8b import build_meta_model, local_batch

    calls = {"forward": 0, "backward": 0}
    original = flash.AttentionPlan.forward

    def counted(*args, **kwargs):
        calls["backward" if in_backward() else "forward"] += 1
        return original(*args, **kwargs)

    flash.AttentionPlan.forward = counted
    try:
        options = small_options(attention="flash_triton", save_attention=save_attention, checkpoint="every:1")
        torch.manual_seed(0)
        model = shard_model(build_meta_model(options), options, torch.device("cpu"))
        tokens, targets = local_batch(options, SMALL["vocab_size"], torch.device("cpu"))
        model(tokens, targets).backward()
        model.finish_gradient_synchronization()
        return {"calls": calls, "grads": model.gather_full_params(grads=True)}
    finally:
        flash.AttentionPlan.forward = original


def _attention_both_ways() -> list[dict]:
    return [_attention_grads(save) for save in (False, True)]


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_saved_attention_runs_no_attention_forward_in_the_backward(run_distributed) -> None:
    """Ours FSDP, every block checkpointed, FlashAttention-2 (Triton interpreter): full recompute runs
    each block's attention forward again in the backward; with attention's output kept, none runs
    there, and every gradient is bitwise the full recompute's."""
    pytest.importorskip("triton")
    layers = SMALL["num_layers"]
    for full, kept in run_distributed(_attention_both_ways, 2, backend="gloo", timeout=90):
        assert full["calls"] == {"forward": layers, "backward": layers}
        assert kept["calls"] == {"forward": layers, "backward": 0}
        assert full["grads"].keys() == kept["grads"].keys()
        for name, grad in full["grads"].items():
            assert torch.equal(kept["grads"][name], grad), name


# -- keep:auto's plan against its budget ----------------------------------------------------------


@pytest.mark.parametrize("budget_gib", [64.0, 72.3, 76.0, 80.0, 100.0, 112.0, 124.0])
@pytest.mark.parametrize("in_backward", [False, True])
@pytest.mark.parametrize("save_attention", [True, False])
def test_keep_auto_plan_fits_its_budget(budget_gib: float, in_backward: bool, save_attention: bool) -> None:
    """8B, 2 GPUs, compiled: keep:auto's N has a predicted peak within the stated budget, and N + 1
    would not fit (the most blocks that do); the peak is the larger of the start of the backward
    and the end (gradient shards: none with the optimizer in the backward)."""
    options = StepOptions(
        compile=True,
        checkpoint="keep:auto",
        keep_budget_gib=budget_gib,
        save_attention=save_attention,
        optimizer_in_backward=in_backward,
    )
    memory = predicted_step_memory(options, 2)
    keep = int(step_checkpoint_policy(options, 2).split(":")[1])
    budget = keep_budget_bytes(options)
    if memory.peak(0) > budget:  # nothing fits: every block checkpointed, the least there is
        assert keep == 0
        return
    assert memory.peak(keep) <= budget
    assert keep == memory.n_blocks or memory.peak(keep + 1) > budget


def test_the_end_of_backward_binds_when_activations_are_small() -> None:
    """Short context: with the plain step every gradient shard is alive at the end of the backward
    and that is the peak; the optimizer in the backward removes it, so more blocks fit the budget."""
    short = StepOptions(compile=True, checkpoint="keep:auto", seq_len=2048)
    plain = predicted_step_memory(short, 2)
    inside = predicted_step_memory(dataclasses.replace(short, optimizer_in_backward=True), 2)
    assert plain.end_of_backward() > plain.start_of_backward(0)
    assert inside.end_of_backward() < inside.start_of_backward(0)
    budget_gib = (plain.end_of_backward() - 1) / GIB
    assert acc.blocks_to_keep(plain, budget_gib * GIB) == 0
    assert acc.blocks_to_keep(inside, budget_gib * GIB) > 0


# -- the course's protocol, the cold start, MFU -------------------------------------------------------


def test_course_counts_are_do_bench_counts() -> None:
    # triton.testing.do_bench: max(1, int(warmup / estimate)), max(1, int(rep / estimate))
    assert ct.course_counts(5000.0, 10_000, 30_000) == ct.CourseCounts(2, 6)
    assert ct.course_counts(4400.0, 10_000, 30_000) == ct.CourseCounts(2, 6)
    assert ct.course_counts(40_000.0, 10_000, 30_000) == ct.CourseCounts(1, 1)


def test_course_do_bench_calls_and_mean() -> None:
    calls = []

    def step() -> None:
        calls.append(1)
        time.sleep(0.01)

    out = ct.course_do_bench(step, torch.device("cpu"), rep_ms=50, warmup_ms=20)
    n = 1 + ct.ESTIMATE_CALLS + out["course_n_warmup"] + out["course_n_repeat"]
    assert len(calls) == n and out["course_n_repeat"] >= 2
    assert 10 <= out["course_mean_ms"] < 40


class ScriptedSteps:
    """A step that takes ``duration_ms(call index)`` on a clock only the steps advance: installed as
    course_timing's ``time``, it is the host clock the protocol reads on a CPU, so every figure is exact."""

    def __init__(self, duration_ms: Callable[[int], float]):
        self.duration_ms, self.now, self.taken = duration_ms, 0.0, []

    def perf_counter(self) -> float:
        return self.now

    def __call__(self) -> None:
        ms = self.duration_ms(len(self.taken))
        self.taken.append(ms)
        self.now += ms / 1e3

    @property
    def clock(self) -> SimpleNamespace:
        """What course_timing reads of the ``time`` module."""
        return SimpleNamespace(perf_counter=self.perf_counter)


def test_course_figure_is_the_mean_of_unequal_steps(monkeypatch) -> None:
    # The course reports do_bench's mean; every third step slow makes the median another number (the
    # existing test's equal steps cannot tell them apart). Break tried: the median -> fails.
    steps = ScriptedSteps(lambda i: 40.0 if i % 3 == 2 else 10.0)
    monkeypatch.setattr(ct, "time", steps.clock)
    out = ct.course_do_bench(steps, torch.device("cpu"), rep_ms=100, warmup_ms=20)
    timed = steps.taken[-out["course_n_repeat"] :]
    assert len(steps.taken) == 1 + ct.ESTIMATE_CALLS + out["course_n_warmup"] + out["course_n_repeat"]
    assert statistics.median(timed) != statistics.fmean(timed)  # or the test could not tell
    assert out["course_mean_ms"] == pytest.approx(statistics.fmean(timed))


def _course_on_ranks(step_ms: list[float]) -> dict:
    """The protocol on this rank with steps of ``step_ms[rank]`` each."""
    steps = ScriptedSteps(lambda i: step_ms[dist.get_rank()])
    ct.time = steps.clock  # (a spawned rank: nothing else of this process reads it)
    return ct.course_do_bench(steps, torch.device("cpu"), rep_ms=200, warmup_ms=60)


@pytest.mark.distributed
@pytest.mark.timeout(90)
def test_course_estimate_is_the_slowest_ranks(run_distributed) -> None:
    # Every rank must make as many calls (each is a collective step), so the estimate the counts come
    # from is agreed over ranks, as the slowest rank's: the fastest's would ask more steps of the slow
    # rank than the course's budget gives it. Break tried: agreed as the minimum -> fails.
    step_ms = [10.0, 30.0]
    results = run_distributed(_course_on_ranks, 2, step_ms, backend="gloo", timeout=60)
    counts = ct.course_counts(max(step_ms), 60, 200)
    for r in results:
        assert r["course_estimate_ms"] == pytest.approx(max(step_ms))
        assert (r["course_n_warmup"], r["course_n_repeat"]) == (counts.n_warmup, counts.n_repeat)


def _rank_result(**changes) -> dict:
    base = dict(
        options={"cold_start_limit_s": 600.0},
        world_size=2,
        step_ms=[5000.0, 5200.0],
        losses=[1.0, 0.9],
        flops_per_step=4.74e15,
        matmul_tflops=781.0,
        device_name="NVIDIA H100 80GB HBM3",
        cold_cache=True,
        run_since_process_start_s=300.0,
    )
    return base | changes


def test_mfu_both_ways_and_the_formula() -> None:
    out = combine_step_results([_rank_result(), _rank_result(matmul_tflops=790.0)])
    tflops = 4.74e15 / 2 / 5.1 / 1e12
    assert out["mfu_measured"] == pytest.approx(tflops / 781.0) == out["mfu"]
    assert out["peak_tflops"] == 989.0 and out["mfu_peak"] == pytest.approx(tflops / 989.0)
    assert out["flop_formula"] == FLOP_FORMULA
    course = combine_step_results([_rank_result(course_mean_ms=5000.0)] * 2)
    assert course["course_mfu_peak"] == pytest.approx(4.74e15 / 2 / 5.0 / 1e12 / 989.0)
    other = combine_step_results([_rank_result(device_name="NVIDIA B200")] * 2)  # no peak known: not guessed
    assert "mfu_peak" not in other and other["mfu_measured"]
    for name, peak in (("NVIDIA H200 NVL", 835.0), ("NVIDIA H100 PCIe", 756.0)):  # not the SXM parts' 989
        assert combine_step_results([_rank_result(device_name=name)] * 2)["peak_tflops"] == peak, name
    assert combine_step_results([_rank_result(device_name="NVIDIA H200")] * 2)["peak_tflops"] == 989.0


@pytest.mark.parametrize(
    "cold, run_s, verdict", [(True, 300.0, True), (True, 601.0, False), (False, 900.0, None)]
)
def test_cold_start_verdict(cold: bool, run_s: float, verdict: bool | None) -> None:
    ranks = [_rank_result(cold_cache=cold), _rank_result(cold_cache=cold, run_since_process_start_s=run_s)]
    assert combine_step_results(ranks)["cold_start_ok"] is verdict


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (torch's pieces): only without CUDA")
@pytest.mark.timeout(120)
def test_cli_fails_a_cold_run_past_the_limit(tmp_path) -> None:
    """The CLI from an empty --cache-dir: exit 0 within the limit, 1 (and a line saying so) past it."""
    from .test_step_8b import run_train_8b

    args = ["--fsdp", "none", "--preset", "tiny", "--steps", "1", "--no-progress"]
    ok = run_train_8b(*args, "--cache-dir", str(tmp_path / "a"))
    assert ok.returncode == 0 and "within the course's 600 s" in ok.stdout, ok.stderr
    late = run_train_8b(*args, "--cache-dir", str(tmp_path / "b"), "--cold-start-limit-s", "0.5")
    assert late.returncode == 1 and "cold start past 0.5 s" in late.stderr, late.stderr
    assert "PAST the course's 0.5 s" in late.stdout, late.stdout
