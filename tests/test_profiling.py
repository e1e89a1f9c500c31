"""D2/D3/D5 tooling: FLOP counts, MFU, the benchmark CLI, the workload, the profiler summary, OOM rows."""

from __future__ import annotations

import contextlib
import functools
import gc
import gzip
import json
import math
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems.cli import benchmark as cli
from cs336_systems.harness import model_case
from cs336_systems.harness.model_case import benchmark_model_case
from cs336_systems.harness.record import Recorder, run_benchmark
from cs336_systems.model import TransformerLM, get_preset
from cs336_systems.profiling import timing
from cs336_systems.profiling import workload as workload_mod
from cs336_systems.profiling.flops import forward_flops, measure_matmul_tflops, mfu, step_flops
from cs336_systems.profiling.memory import measure_peak, memory_history, memory_stats, snapshot_step
from cs336_systems.profiling.profiler import RANGES, kernel_category, profile_step, summarize
from cs336_systems.profiling.workload import Case, Workload

SRC = Path(__file__).resolve().parents[1] / "src"


# ----------------------------------------------------------------------------------------- FLOPs


def test_forward_flops_hand_count():
    # tiny: d=64, d_ff=256, 2 layers, 4 heads (d_head 16), vocab 10,000; batch 2, ctx 16 -> 32 tokens
    f = forward_flops(get_preset("tiny"), batch=2, ctx=16)
    assert f.qkv_proj == 2 * (2 * 32 * 64 * 192)
    assert f.output_proj == 2 * (2 * 32 * 64 * 64)
    assert f.ffn == 2 * 3 * (2 * 32 * 64 * 256)
    assert f.attn_scores == f.attn_values == 2 * (2 * (2 * 4) * 16 * 16 * 16)
    assert f.lm_head == 2 * 32 * 64 * 10_000
    assert f.total == 1_572_864 + 524_288 + 6_291_456 + 2 * 131_072 + 40_960_000
    assert f.attn_softmax == 2 * 5 * (2 * 4 * 16 * 16)


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd"])
def test_flops_match_torch_flop_counter(mode):
    config, batch, ctx = get_preset("tiny"), 2, 16
    model = TransformerLM(config)
    tokens = torch.randint(0, config.vocab_size, (batch, ctx), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        logits = model(tokens)
        if mode == "fwd_bwd":
            logits.sum().backward()
    assert counter.get_total_flops() == step_flops(config, batch, ctx, mode)


def test_step_flops_modes_and_errors():
    config = get_preset("small")
    fwd = forward_flops(config, 4, 512).total
    assert step_flops(config, 4, 512, "fwd") == fwd
    assert step_flops(config, 4, 512, "fwd_bwd") == step_flops(config, 4, 512, "train") == 3 * fwd
    with pytest.raises(ValueError, match="unknown mode"):
        step_flops(config, 4, 512, "backward")


def test_mfu():
    assert mfu(1e12, 0.01, 200.0) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        mfu(1e12, 0.0, 200.0)


def test_measure_matmul_tflops_cpu():
    rate = measure_matmul_tflops("cpu", torch.float32, n=128, iters=2, trials=1)
    assert math.isfinite(rate) and rate > 0
    with pytest.raises(ValueError, match="matmul rate"):
        measure_matmul_tflops("cpu", torch.int32)


# -------------------------------------------------------------------------------------- workload


def test_case_ids_and_validation():
    assert Case("xl", 512, "train", "bf16", True).id == "xl-ctx512-bf16-train-compiled"
    assert Case("small", 256, "forward", "fp32", attention="sdpa").id == "small-ctx256-fp32-fwd-eager-sdpa"
    assert Case("tiny", 300).config.context_length == 300  # RoPE table grows with the context
    graphed = Case("xl", 512, "fwd_bwd", "bf16", True, "flash_triton", cudagraphs=True)
    assert graphed.id == "xl-ctx512-bf16-fwd_bwd-cudagraphs-flash_triton"
    assert graphed.info()["compile"] == "cudagraphs" and graphed.info()["compiled"]
    for kwargs, message in [
        ({"dtype": "fp16"}, "precision"),
        ({"mode": "backward"}, "mode"),
        ({"attention": "nope"}, "attention"),
        ({"ctx": 0}, "positive"),
        ({"cudagraphs": True}, "need the compiled model"),
    ]:
        with pytest.raises(ValueError, match=message):
            Case(**{"size": "tiny", "ctx": 16, **kwargs})
    with pytest.raises(ValueError, match="preset"):
        Case("huge", 16)


def _tiny(mode: str, dtype: str = "fp32", **kw) -> Case:
    return Case("tiny", 16, mode, dtype, batch=2, **kw)


def test_workload_modes_do_what_they_say():
    with Workload(_tiny("fwd"), "cpu") as w:
        before = [p.detach().clone() for p in w.model.parameters()]
        w.step()
        assert all(p.grad is None for p in w.model.parameters())
    with Workload(_tiny("fwd_bwd"), "cpu") as w:
        w.step()
        assert all(p.grad is not None for p in w.model.parameters())
        assert all(torch.equal(a, b) for a, b in zip(before, w.model.parameters(), strict=True))
        first = [p.grad.clone() for p in w.model.parameters()]
        w.step()  # starts from no gradients: the same ones again, not twice them
        assert all(torch.equal(a, p.grad) for a, p in zip(first, w.model.parameters(), strict=True))
    with Workload(_tiny("train"), "cpu") as w:
        w.step()
        assert not all(torch.equal(a, b) for a, b in zip(before, w.model.parameters(), strict=True))
    assert "model" not in w.__dict__  # closed: model and optimizer released


def test_workload_bf16_autocast_keeps_fp32_params():
    with Workload(_tiny("fwd_bwd", "bf16"), "cpu") as w:
        assert w.forward().dtype == torch.bfloat16
        w.step()
        assert {p.dtype for p in w.model.parameters()} == {torch.float32}
        assert {p.grad.dtype for p in w.model.parameters()} == {torch.float32}


def test_compiled_model_has_no_graph_breaks():
    # NVTX/record_function ranges must not split the compiled graph (one break per layer otherwise).
    with Workload(_tiny("fwd", compile=True), "cpu", compile_backend="eager") as w:
        explained = torch._dynamo.explain(w.model)(w.inputs)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]


# ------------------------------------------------------------------------------ timing, warm-up, OOM


def test_run_benchmark_warmup_and_rounds():
    for warmup in (0, 2):
        calls: list[int] = []
        rec = Recorder()
        step = functools.partial(calls.append, 1)
        times = run_benchmark(rec, step, torch.device("cpu"), warmup=warmup, rounds=3, tag="x")
        assert len(calls) == warmup + 3 and len(times) == len(rec.stats) == 3
        assert (
            rec.extra_info["tag"] == "x" and rec.extra_info["oom"] is False and rec.extra_info["mean_ms"] >= 0
        )


def _oom() -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


@pytest.mark.parametrize("where", ["warmup", "timed"])
def test_run_benchmark_oom_is_a_row(where):
    calls = []

    def step():
        calls.append(1)
        if where == "warmup" or len(calls) > 1:
            _oom()

    rec = Recorder()
    warmup = 1 if where == "warmup" else 0
    assert run_benchmark(rec, step, torch.device("cpu"), warmup=warmup, rounds=3, size="xl") is None
    assert rec.extra_info["oom"] is True and rec.extra_info["size"] == "xl"
    assert len(calls) == 2 if where == "timed" else len(calls) == 1  # no step after the OOM


def test_run_case_oom_in_build_is_a_row(monkeypatch):
    def boom(self, *args, **kwargs):
        _oom()

    monkeypatch.setattr(workload_mod.Workload, "__init__", boom)
    info = benchmark_model_case(
        Recorder(), Case("2.7B", 512, "train"), torch.device("cpu"), warmup=1, rounds=2
    )
    assert info["oom"] is True and info["size"] == "2.7B" and info["mode"] == "train"
    assert "mean_ms" not in info


def test_run_case_fills_extra_info_and_survives_oom_in_after():
    def after(w):
        _oom()

    info = benchmark_model_case(
        Recorder(), _tiny("train"), torch.device("cpu"), warmup=0, rounds=2, peak_tflops=1.0, after=after
    )
    for key in ("mean_ms", "std_ms", "first_ms", "tokens_per_s", "model_flops", "mfu", "params", "warmup"):
        assert key in info, key
    assert info["oom"] is False and info["after_oom"] is True
    assert info["tokens_per_s"] == pytest.approx(2 * 16 / (info["mean_ms"] / 1e3))


def test_bench_grid_ids_and_markers():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    try:
        import bench_model
    finally:
        sys.path.pop(0)
    _, cases = bench_model._model_cases()
    ids = {c.id: c for c in cases}
    assert "xl-ctx512-bf16-train-compiled" in ids and "xl-ctx512-bf16-train-compiled-sdpa" in ids
    marks = {c.id: {m.name for m in c.marks} for c in cases}
    assert marks["small-ctx256-fp32-fwd-compiled"] == {"gpu"}
    assert marks["xl-ctx512-bf16-train-compiled"] == {"gpu"}
    assert marks["large-ctx1024-fp32-train-compiled"] == {"gpu", "slow", "skipif"}  # CS336_FULL_GRID=1
    assert marks["large-ctx1024-fp32-train-eager"] == {"gpu", "slow"}
    assert marks["tiny-ctx32-fp32-fwd_bwd-eager"] == set()


# ------------------------------------------------------------------------------------------- CLI


@pytest.mark.parametrize("mode", ["fwd", "fwd_bwd", "train"])
def test_cli_runs_tiny_on_cpu(mode, capsys, tmp_path):
    out = tmp_path / "rows.json"
    args = [
        "--size",
        "tiny",
        "--context",
        "16",
        "--batch",
        "2",
        "--mode",
        mode,
        "--warmup",
        "1",
        "--steps",
        "2",
    ]
    assert cli.main([*args, "--device", "cpu", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert f"tiny-ctx16-fp32-{mode}-eager-b2" in printed and "MFU %" in printed
    (row,) = json.loads(out.read_text())
    assert row["mode"] == mode and row["mean_ms"] > 0 and row["mfu"] > 0
    assert row["torch_threads"] == torch.get_num_threads()


def test_cli_sweeps_the_product(capsys):
    args = (
        "--size tiny --context 8 16 --dtype fp32 bf16 --mode fwd --warmup 0 --steps 1 --no-mfu --device cpu"
    )
    assert cli.main(args.split()) == 0
    table = capsys.readouterr().out.split("peak MiB")[-1]
    assert table.count("tiny-ctx") == 4 and "bf16" in table


def test_cli_compiled_train_runs(capsys):
    args = "--size tiny --context 16 --batch 2 --mode train --compile --compile-backend aot_eager"
    assert cli.main([*args.split(), "--warmup", "1", "--steps", "1", "--no-mfu", "--device", "cpu"]) == 0
    assert "tiny-ctx16-fp32-train-compiled-b2" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ("--memory-snapshot x.pickle --device cpu", "needs a CUDA device"),
        ("--attention nope --device cpu", "unknown attention"),
        ("--steps 0 --device cpu", "--steps >= 1"),
        ("--size huge", "invalid choice"),
        ("--device gpu0", "--device 'gpu0' is not a device; use cpu, cuda or cuda:N"),
        ("--device mps", "runs on cpu, cuda or cuda:N"),
        ("--device cuda:99", "--device 'cuda:99': "),  # no GPU here, or fewer than 100
        ("--profile-steps 0 --profile prof --device cpu", "--profile-steps >= 1"),
        ("--json . --device cpu", "is a directory"),
        ("--compile --compile-backend nosuch --device cpu", "not a torch.compile backend"),
        ("--compile --cudagraphs --device cpu", "--cudagraphs needs a CUDA device"),
        ("--cudagraphs --device cpu", "need the compiled model"),
    ],
)
def test_cli_rejects_bad_input(args, message, capsys, monkeypatch):
    # Rejected before anything runs: no rate probe, no case.
    # main imports these where it uses them: patched where it finds them
    monkeypatch.setattr(
        workload_mod, "peak_rate", lambda *a, **k: pytest.fail("probed before checking arguments")
    )
    monkeypatch.setattr(
        model_case,
        "benchmark_model_case",
        lambda *a, **k: pytest.fail("ran a case before checking arguments"),
    )
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--size", "tiny", *args.split()])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_device_cuda_without_a_gpu_is_an_argparse_error(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # a CPU-only machine, on any machine
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--size", "tiny", "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device 'cuda': no CUDA GPU is available here" in capsys.readouterr().err


def test_cli_reports_progress_on_stderr(capsys):
    args = "--size tiny --context 8 --batch 1 --mode fwd --warmup 2 --steps 3 --device cpu"
    assert cli.main(args.split()) == 0
    printed = capsys.readouterr()
    err = printed.err.splitlines()
    case = "[1/1] tiny-ctx8-fp32-fwd-eager-b1"
    assert err[0] == "measuring the fp32 matmul rate on cpu (the MFU denominator)"
    assert err[1] == f"{case}: building the model"
    phases = [re.match(rf"{re.escape(case)}: (.+?) \[#* *\] [\d.]+ s$", line)[1] for line in err[2:-1]]
    assert phases[0] == "warm-up 0/2" and phases[-1] == "step 3/3" and "warm-up 2/2" in phases
    assert err[-1].startswith(f"{case}: done in ")
    assert "building the model" not in printed.out  # stdout keeps only the tables


def test_cli_profile_writes_summary_and_trace(tmp_path, capsys):
    args = "--size tiny --context 16 --batch 2 --mode train --warmup 1 --steps 1 --no-mfu --device cpu"
    assert cli.main([*args.split(), "--profile", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "top kernels, forward" in printed and "optimizer step" in printed
    stem = "tiny-ctx16-fp32-train-eager-b2"
    with gzip.open(tmp_path / f"{stem}.trace.json.gz") as f:
        trace = json.load(f)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"forward", "backward", "optimizer step", "computing softmax"} <= names
    answers = json.loads((tmp_path / f"{stem}.d3.json").read_text())
    # which op tops a 2-layer toy on a busy CPU is noise; that the answer is there is the point here
    assert answers["forward_top_kernel"].startswith("aten::") and answers["forward_top_kernel_calls"] >= 1
    assert 0 < answers["matmul_share_forward"] < 1
    assert (tmp_path / f"{stem}.kernels.csv").stat().st_size > 0


def test_cli_entry_point():
    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1"}
    args = ["--size", "tiny", "--context", "8", "--batch", "1", "--mode", "fwd", "--steps", "1", "--no-mfu"]
    result = subprocess.run(
        [sys.executable, "-m", "cs336_systems.cli.benchmark", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert "tiny-ctx8-fp32-fwd-eager-b1" in result.stdout


# -------------------------------------------------------------------------------------- profiler


def test_profile_summary_on_cpu_attributes_ops_to_ranges():
    with Workload(_tiny("train"), "cpu") as w:
        summary = profile_step(w.step, "cpu", steps=2, warmup=1)
    table = summary.range_table().set_index("range")
    assert set(RANGES) <= set(table.index)
    assert (table["kernel_ms"] > 0).all()
    # per forward: 5 projections x 2 layers + LM head = 11 mm; QK^T and PV x 2 layers = 4 bmm
    forward = summary.top_kernels("forward", n=None).set_index("kernel")
    assert forward.loc["aten::mm", "calls_per_step"] == 11
    assert forward.loc["aten::bmm", "calls_per_step"] == 4
    fwd_bwd = summary.top_kernels(["forward", "loss", "backward"], n=None).set_index("kernel")
    assert fwd_bwd.loc["aten::mm", "calls_per_step"] == 33  # backward: grad input + grad weight each
    softmax = summary.top_kernels("computing softmax", n=None)
    assert "aten::_softmax" in set(softmax["kernel"])
    answers = summary.d3_answers(forward_flops(w.case.config, 2, 16))
    assert 0 < answers["matmul_share_forward"] <= 1 and answers["optimizer_ms"] > 0
    assert answers["attn_softmax_flops"] < answers["attn_scores_flops"]


def _event(name, start, end, kernels=(), thread=1):
    cpu = torch.autograd.DeviceType.CPU
    return SimpleNamespace(
        name=name,
        time_range=SimpleNamespace(start=start, end=end),
        device_type=cpu,
        kernels=[SimpleNamespace(name=k, duration=d) for k, d in kernels],
        self_cpu_time_total=0,
        thread=thread,
    )


def test_summarize_cuda_kernels_by_launch_time_across_threads():
    events = [
        _event("profiled step", 0, 100),
        _event("forward", 0, 40),
        _event("computing softmax", 10, 20),
        _event("aten::mm", 1, 2, [("sm90_xmma_gemm_f32f32", 30.0)]),
        _event("aten::_softmax", 12, 13, [("softmax_warp_forward", 5.0)]),
        _event("backward", 50, 90),
        # backward ops run on autograd's thread, outside the Python stack of the "backward" range
        _event("MmBackward0", 60, 61, [("nvjet_tst_128x64", 50.0), ("nvjet_tst_128x64", 50.0)], thread=2),
        _event("aten::add_", 95, 96, [("vectorized_elementwise_kernel", 1.0)]),
        _event("aten::mm", 120, 121, [("sm90_xmma_gemm_f32f32", 99.0)]),  # outside the step: dropped
    ]
    summary = summarize(events, steps=1, device_type="cuda")
    assert summary.kernel_ms() == pytest.approx(0.136)
    assert summary.kernel_ms("forward") == pytest.approx(0.035)
    assert summary.kernel_ms("backward") == pytest.approx(0.100)
    assert summary.kernel_ms("computing softmax") == pytest.approx(0.005)
    assert summary.category_share("forward") == pytest.approx(30 / 35)
    top = summary.top_kernels("backward")
    assert top.loc[0, "kernel"] == "nvjet_tst_128x64" and top.loc[0, "calls_per_step"] == 2
    answers = summary.d3_answers()
    assert answers["forward_top_kernel"] == "sm90_xmma_gemm_f32f32"
    assert answers["fwd_bwd_top_kernel"] == "nvjet_tst_128x64" and answers["same_top_kernel"] is False
    assert answers["attn_softmax_ms"] == pytest.approx(0.005)
    with pytest.raises(ValueError, match="unknown ranges"):
        summary.kernel_ms("nope")


@pytest.mark.parametrize(
    ("name", "category"),
    [
        ("nvjet_tst_192x192_64x4_2x1_v_bz_coopB_TNT", "matmul"),
        ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64", "matmul"),
        ("ampere_sgemm_128x64_nn", "matmul"),
        (
            "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_64x1_tn_align8>",
            "matmul",
        ),
        ("triton_tem_fused_mm_0", "matmul"),
        ("aten::mm", "matmul"),
        ("aten::bmm", "matmul"),
        ("aten::matmul", "other"),  # dispatches to mm/bmm, its self time is not matmul work
        ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>", "attention"),
        ("fmha_cutlassF_f32_aligned_64x64_rf_sm80", "attention"),
        ("void at::native::vectorized_elementwise_kernel<4, at::native::exp_kernel_cuda>", "other"),
        ("triton_red_fused__softmax_0", "other"),
    ],
)
def test_kernel_category(name, category):
    assert kernel_category(name) == category


# ---------------------------------------------------------------------------------------- memory


def test_memory_helpers_on_cpu(tmp_path):
    assert memory_stats("cpu") == {}
    assert measure_peak(lambda: None, "cpu") is None
    with pytest.raises(ValueError, match="needs a CUDA device"), memory_history(tmp_path / "m.pickle", "cpu"):
        pass
    with pytest.raises(ValueError, match="needs a CUDA device"):
        snapshot_step(lambda: None, tmp_path / "m.pickle", "cpu")


@pytest.mark.gpu
def test_memory_snapshot_on_gpu(tmp_path):
    path = tmp_path / "snap.pickle"
    with Workload(_tiny("train"), "cuda") as w:
        stats = snapshot_step(w.step, path, "cuda")
    snapshot = pickle.loads(path.read_bytes())
    assert {"segments", "device_traces"} <= set(snapshot)
    assert any(trace for trace in snapshot["device_traces"])  # allocations of the step were recorded
    assert stats["snapshot_peak_mib"] > 0


@pytest.mark.gpu
def test_profile_summary_on_gpu_finds_kernels():
    with Workload(_tiny("train"), "cuda") as w:
        summary = profile_step(w.step, "cuda", steps=1, warmup=1)
    assert summary.device_type == "cuda"
    assert summary.category_share("forward") > 0  # cuBLAS kernels recognized as matmuls
    assert summary.kernel_ms("backward") > 0 and summary.kernel_ms("optimizer step") > 0
    assert summary.kernel_ms("computing softmax") > 0


def test_timing_pauses_the_garbage_collector() -> None:
    # Timed reps run with the collector off (a pass in a big pytest process would land in a rep), and it is
    # back on afterwards, or stays off when the caller had turned it off.
    seen = []
    timing.device_time(lambda: seen.append(gc.isenabled()), torch.device("cpu"), warmup_ms=0, rep_ms=1)
    assert seen and not any(seen)
    assert gc.isenabled()
    gc.disable()
    try:
        with timing.gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_interleaved_rounds_pair_steps_under_host_drift() -> None:
    # A host whose speed changes between rounds: step "b" costs twice "a" in every round. Timing each
    # step's rounds back to back would compare a slow host with a fast one; interleaved rounds give
    # every round both steps, so the paired ratio is exactly 2 and the rotation varies who goes first.
    speed = iter([1.0, 1.0, 3.0, 3.0, 0.5, 0.5, 2.0, 2.0])
    order = []

    def measure(fn, *, warmup_ms, rep_ms, grad_to_none):
        return [fn() * next(speed)] * 3

    steps = {"a": lambda: order.append("a") or 1.0, "b": lambda: order.append("b") or 2.0}
    out = timing.interleaved_device_time(
        steps, torch.device("cpu"), rounds=4, warmup_ms=0, rep_ms=1, measure=measure
    )
    assert order == ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert out["a"]["do_bench_round_ms"] == [1.0, 3.0, 0.5, 2.0]
    assert out["b"]["do_bench_round_ms"] == [2.0, 6.0, 1.0, 4.0]
    assert timing.paired_ratio(out["b"]["do_bench_round_ms"], out["a"]["do_bench_round_ms"]) == 2.0
    assert out["a"]["do_bench_ms"] == 1.5 and out["a"]["do_bench_best_round_ms"] == 0.5
    assert out["b"]["do_bench_rounds"] == 4 and out["b"]["do_bench_reps"] == 12


def test_interleaved_rounds_enter_contexts_per_round_not_per_call() -> None:
    entered = []

    @contextlib.contextmanager
    def pin():
        entered.append(1)
        yield

    calls = []
    out = timing.interleaved_device_time(
        {"x": lambda: calls.append(1)},
        torch.device("cpu"),
        rounds=2,
        warmup_ms=0,
        rep_ms=1,
        contexts={"x": pin},
    )
    assert len(entered) == 2 and len(calls) > 2 and out["x"]["timer"] == "host"
    with pytest.raises(ValueError, match="rounds must be >= 1"):
        timing.interleaved_device_time(
            {"x": lambda: None}, torch.device("cpu"), rounds=0, warmup_ms=0, rep_ms=1
        )
