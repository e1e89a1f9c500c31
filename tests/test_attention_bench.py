"""CPU tests of the attention-bench helpers (``harness.attention``, ``profiling.flops`` / ``timing``,
``harness.record``) and a run of the CPU variants of bench/bench_attention.py and bench/bench_flash.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from cs336_systems import report
from cs336_systems.attention import get_attention_fn
from cs336_systems.harness import attention as ab
from cs336_systems.harness import record
from cs336_systems.harness.settings import Settings
from cs336_systems.profiling import flops, timing

REPO = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------------------------- FLOPs


def test_attention_flops_hand_count() -> None:
    # batch 2, 3 heads, 8 queries x 8 keys, d 4: Q K^T and P V are 2*3*8*8*4 = 1536 multiply-adds each.
    assert flops.attention_flops(2, 8, 4, heads=3, causal=False) == 2 * 1536 * 2
    assert flops.attention_flops(2, 8, 4, heads=3, causal=True) == 1536 * 2
    assert flops.attention_flops(1, 8, 4, causal=False, n_keys=16) == 4 * 8 * 16 * 4
    fwd = flops.attention_flops(1, 64, 16)
    assert flops.attention_flops(1, 64, 16, pass_="bwd") == 2.5 * fwd
    assert flops.attention_flops(1, 64, 16, pass_="fwd_bwd") == 3.5 * fwd


def test_attention_flops_matches_flop_counter() -> None:
    """torch's FlopCounterMode on the eager attention: forward equals ours (non-causal: it counts the
    dense matmuls); its backward (4 matmuls) plus the recomputation of Q K^T that FlashAttention-2's
    backward does (half a forward) is our 2.5x convention."""
    batch, seq, d = 2, 32, 16
    q, k, v = ab.make_qkv(batch, seq, d, "fp32", "cpu")
    attention = get_attention_fn("pytorch")
    with FlopCounterMode(display=False) as fwd_counter:
        out = attention(q, k, v, False)
    with FlopCounterMode(display=False) as bwd_counter:
        out.backward(torch.ones_like(out))
    fwd = flops.attention_flops(batch, seq, d, causal=False)
    assert fwd_counter.get_total_flops() == fwd
    assert bwd_counter.get_total_flops() + fwd / 2 == flops.attention_flops(
        batch, seq, d, causal=False, pass_="bwd"
    )


def test_attention_flops_rejects_unknown_pass() -> None:
    with pytest.raises(ValueError, match="unknown pass 'both'"):
        flops.attention_flops(1, 8, 4, pass_="both")


def test_tflops() -> None:
    assert flops.tflops(2e12, 1000.0) == pytest.approx(2.0)
    assert flops.tflops(1e9, 1.0) == pytest.approx(1.0)


# -------------------------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("dtype", ["fp32", "bf16", torch.bfloat16])
def test_make_qkv_shapes_dtypes(dtype) -> None:
    q, k, v = ab.make_qkv(2, 16, 8, dtype, "cpu")
    expected = ab.as_dtype(dtype)
    for t in (q, k, v):
        assert t.shape == (2, 16, 8) and t.dtype == expected and t.requires_grad and t.is_leaf
        assert t.device.type == "cpu" and t.is_contiguous()
    assert not torch.equal(q, k)
    heads = ab.make_qkv(1, 16, 8, dtype, "cpu", heads=4, requires_grad=False)
    assert all(t.shape == (1, 4, 16, 8) and not t.requires_grad for t in heads)


def test_make_qkv_is_seeded() -> None:
    first = ab.make_qkv(1, 8, 4, "fp32", "cpu")
    again = ab.make_qkv(1, 8, 4, "fp32", "cpu")
    other = ab.make_qkv(1, 8, 4, "fp32", "cpu", seed=1)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not torch.equal(first[0], other[0])
    assert ab.make_grad(first[0]).shape == first[0].shape and not ab.make_grad(first[0]).requires_grad


def test_bad_dtype_is_named() -> None:
    with pytest.raises(ValueError, match="unknown dtype 'fp8'"):
        ab.make_qkv(1, 8, 4, "fp8", "cpu")


def test_settings_read_integer_knobs() -> None:
    assert Settings.from_env({}).d6_passes == 100
    assert Settings.from_env({"CS336_D6_PASSES": "12"}).d6_passes == 12
    with pytest.raises(ValueError, match="CS336_D6_PASSES must be an integer"):
        Settings.from_env({"CS336_D6_PASSES": "many"})


# ------------------------------------------------------------------------------------ implementations


@pytest.mark.parametrize("impl", list(ab.SDPA_BACKENDS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_sdpa_support_detection_agrees_with_running(impl: str, dtype: torch.dtype) -> None:
    """The probe says unsupported exactly when pinning the backend makes SDPA fail on this device."""
    reason = ab.sdpa_unsupported_reason(impl, dtype, 16, "cpu")
    q, k, v = ab.make_qkv(1, 64, 16, dtype, "cpu", heads=2)
    try:
        with sdpa_kernel(ab.SDPA_BACKENDS[impl]):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        runs = True
    except RuntimeError:
        runs = False
    assert (reason is None) == runs
    if reason is not None:
        assert impl in reason and "d=16" in reason


def test_sdpa_support_detection_on_cpu() -> None:
    # cuDNN and the memory-efficient kernels are CUDA-only in every torch build.
    assert ab.sdpa_unsupported_reason("sdpa_cudnn", torch.bfloat16, 64, "cpu") is not None
    assert ab.sdpa_unsupported_reason("sdpa_efficient", torch.float32, 64, "cpu") is not None
    with pytest.raises(ValueError, match="not an SDPA backend"):
        ab.sdpa_unsupported_reason("pytorch", torch.float32, 64, "cpu")


@pytest.mark.parametrize("heads", [None, 3])
def test_sdpa_attention_matches_reference(heads: int | None) -> None:
    q, k, v = ab.make_qkv(2, 32, 16, "fp32", "cpu", heads=heads, requires_grad=False)
    expected = get_attention_fn("pytorch")(q, k, v, True)
    torch.testing.assert_close(ab.sdpa_attention(q, k, v, is_causal=True), expected, atol=1e-5, rtol=1e-5)


def test_impl_context_pins_only_sdpa() -> None:
    q, k, v = ab.make_qkv(1, 32, 16, "fp32", "cpu", heads=1)
    with ab.impl_context("sdpa_cudnn"), pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # cuDNN has no CPU kernel
    with ab.impl_context("pytorch"):
        F.scaled_dot_product_attention(q, k, v, is_causal=True)  # not pinned: torch picks one


def test_resolve_impl_names() -> None:
    assert ab.resolve_impl("pytorch", None) is get_attention_fn("pytorch")
    assert ab.resolve_impl("sdpa_flash", None) is ab.sdpa_attention
    with pytest.raises(ValueError, match="unknown attention impl 'flash'"):
        ab.resolve_impl("flash", None)


def test_missing_flash_triton_fails_clearly(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry in sys.modules makes the import raise ImportError, as when the file is absent.
    monkeypatch.setitem(sys.modules, "cs336_systems.attention.flash_triton", None)
    with pytest.raises(RuntimeError, match="FlashAttentionTriton"):
        ab.resolve_impl("flash_triton", None)


def test_static_compile_cache_one_compile_per_shape() -> None:
    cache = ab.StaticCompileCache()
    fn = ab.compilable_attention()  # torch.compile wraps lazily: nothing compiles in this test
    first = cache.get(fn, ("fp32", 16, 128))
    assert cache.get(fn, ("fp32", 16, 128)) is first
    assert cache.get(fn, ("fp32", 16, 256)) is not first
    assert fn is not get_attention_fn("pytorch_compiled")


@pytest.mark.parametrize("pass_", ab.PASSES)
def test_pass_step_computes_the_pass(pass_: str) -> None:
    q, k, v = ab.make_qkv(1, 16, 8, "fp32", "cpu")
    attention = get_attention_fn("pytorch")
    step = ab.PassStep(attention, q, k, v, pass_)
    step()
    if pass_ == "fwd":
        assert q.grad is None
    else:
        expected = torch.autograd.grad(attention(q, k, v, True), q, step.dout)[0]
        torch.testing.assert_close(q.grad, expected)
    if pass_ == "bwd":
        step()  # the retained graph allows repeated backward passes
    step.close()
    assert q.grad is None and step.out is None and step.dout is None
    with pytest.raises(ValueError, match="unknown pass"):
        ab.PassStep(attention, q, k, v, "step")


# -------------------------------------------------------------------------------------------- timing


def test_device_time_on_cpu_uses_host_clock() -> None:
    q, k, _ = ab.make_qkv(1, 16, 8, "fp32", "cpu")
    grads_seen: list[bool] = []

    def step() -> None:
        grads_seen.append(q.grad is None)
        (q * k).sum().backward()

    result = timing.device_time(step, torch.device("cpu"), warmup_ms=1, rep_ms=5, grad_to_none=[q])
    assert result["timer"] == "host"
    assert 1 <= result["do_bench_reps"] <= 100
    assert 0 < result["do_bench_min_ms"] <= result["do_bench_p20_ms"] <= result["do_bench_ms"]
    assert result["do_bench_ms"] <= result["do_bench_p80_ms"]
    # each timed rep starts with q.grad reset, like do_bench's grad_to_none
    assert all(grads_seen[-result["do_bench_reps"] :])


def test_launch_time_on_cpu_times_each_call_with_its_grads_reset() -> None:
    x = torch.ones(4, requires_grad=True)
    calls = []

    def step() -> None:
        assert x.grad is None, "launch_time must reset grad_to_none before each call"
        x.sum().backward()
        calls.append(1)

    ms = timing.launch_time(step, torch.device("cpu"), reps=7, grad_to_none=[x])
    assert isinstance(ms, float) and ms > 0 and len(calls) == 7


def test_rounds_for_is_bounded() -> None:
    assert timing.rounds_for(0.001) == 20
    assert timing.rounds_for(10.0) == 10
    assert timing.rounds_for(500.0) == 3


def test_record_not_run_makes_a_row() -> None:
    calls = []
    fake = SimpleNamespace(extra_info={}, pedantic=lambda fn, **kw: calls.append(kw) or fn())
    record.record_not_run(fake, "unsupported", "no fp32 kernel", impl="sdpa_flash")
    assert fake.extra_info == {
        "impl": "sdpa_flash",
        "status": "unsupported",
        "reason": "no fp32 kernel",
        "skipped": "no fp32 kernel",
        "oom": False,
    }
    assert calls == [{"rounds": 1, "iterations": 1}]


# ------------------------------------------------------------------------------- the benches on CPU


BENCH_RUN = pytest.mark.xdist_group("bench_cpu_variants")  # one worker runs the benches once for both tests


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """The CPU-capable cases of both bench files, run once: their JSON and their row log."""
    tmp_path = tmp_path_factory.mktemp("bench_cpu_variants")
    out_json, out_jsonl = tmp_path / "out.json", tmp_path / "rows.jsonl"
    # One thread: the suite runs with -n 2 on 2 cores, and oversubscribed OpenMP threads crawl.
    env = dict(
        os.environ,
        CS336_BENCH_JSONL=str(out_jsonl),
        CS336_D6_PASSES="5",
        CS336_SHAPE_ROUNDS="2",
        OMP_NUM_THREADS="1",
    )
    # Under pytest-xdist, PYTEST_XDIST_WORKER would make the inner pytest-benchmark disable itself.
    env = {key: value for key, value in env.items() if not key.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
        "bench/bench_attention.py::test_attention_eager_vs_compiled",
        "bench/bench_flash.py::test_flash_sweep",
        "bench/bench_flash.py::test_attention_shapes",
        "--only", "impl=pytorch,pytorch_compiled,sdpa_flash,sdpa_cudnn,sdpa_efficient,flash_triton",
        "--only", "seq=128,256", "--only", "d=16",
        # D6 runs at seq 256, the D11 sweep at seq 128 (its seq-256 cases are GPU-only, so on a GPU
        # machine they would run too and the checks below would see two rows per key); the attention
        # shapes group at its CPU shape (ours under the interpreter on a CPU-only machine).
        "-k", "not (pytorch_compiled and (bf16 or seq256)) and not (test_flash_sweep and (seq256 or flash_triton))"
        " and not (test_attention_shapes and not b1-h2-q64)",
        f"--benchmark-json={out_json}",
    ]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    return out_json, out_jsonl


def _d11_rows(out_json: Path) -> dict[tuple[str, str, str], dict]:
    rows = json.loads(out_json.read_text())["benchmarks"]
    return {
        (i["impl"], i["dtype"], i["pass_"]): i
        for i in (r["extra_info"] for r in rows if r["group"] == "D11 flash sweep")
    }


@BENCH_RUN
def test_bench_cpu_variants_run(bench_run: tuple[Path, Path]) -> None:
    """The CPU-capable cases of both bench files run and write the rows the tables need."""
    out_json, out_jsonl = bench_run
    rows = json.loads(out_json.read_text())["benchmarks"]
    d6 = [r["extra_info"] for r in rows if r["group"].startswith("D6/D7a")]
    d11 = _d11_rows(out_json)
    assert len(d6) == 1 and d6[0]["status"] == "ok" and d6[0]["passes"] == 5
    assert d6[0]["fwd_ms"] > 0 and d6[0]["bwd_ms"] > 0 and d6[0]["deliverable"] == "D6"
    assert len(d11) == 5 * 3 * 2 - 3  # 5 impls x 3 passes x 2 dtypes, no compiled bf16
    for (impl, dtype, pass_), info in d11.items():
        assert info["d"] == 16 and info["seq"] == 128 and info["causal"] is True
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if impl in ab.SDPA_BACKENDS and ab.sdpa_unsupported_reason(impl, ab.as_dtype(dtype), 16, device_type):
            assert info["status"] == "unsupported" and impl in info["reason"]
        else:
            assert info["status"] == "ok", (impl, dtype, pass_, info)
            assert info["do_bench_ms"] > 0 and info["timer"] == (
                "do_bench" if torch.cuda.is_available() else "host"
            )
            expected_flops = flops.attention_flops(1, 128, 16, pass_=pass_)
            assert info["flops"] == expected_flops
            assert info["tflops"] == pytest.approx(flops.tflops(expected_flops, info["do_bench_ms"]))
            assert info["mean_ms"] > 0  # pytest-benchmark rounds ran too
        if not torch.cuda.is_available():  # a CPU row is host-timed already: no issue time, no graph
            assert not {"launch_ms", "host_bound", "graph_ms", "graph_error"} & set(info), info
    _check_shapes_rows(
        [r["extra_info"] for r in rows if r["extra_info"].get("group_key") == "attention_shapes"]
    )
    logged = [json.loads(line) for line in out_jsonl.read_text().splitlines()]
    assert len(logged) == len(rows)
    # The row log is what survives a cut-off sweep: the report reads it like the JSON.
    _, from_log = report.load([out_jsonl])
    _, from_json = report.load([out_json])
    assert sorted(r.name for r in from_log) == sorted(r.name for r in from_json)
    assert any(t.group == "D11 flash sweep" for t in report.build_tables(from_log))


# Captured in CUDA graphs in the D11 run on 4 x H200 of 2026-11-28 (docs/results/sweep/h200x4-d11-plain.json).
GRAPHED_ON_H200 = ("flash_triton", "sdpa_flash", "sdpa_cudnn")


@BENCH_RUN
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="launch_ms and graph_ms are CUDA rows' (no GPU here)"
)
def test_d11_cuda_rows_say_whether_they_are_host_bound(bench_run: tuple[Path, Path]) -> None:
    """D11's CUDA rows carry the host's issue time, the verdict drawn from it, and (fwd, fwd_bwd) the
    device time alone from a CUDA graph; bwd cannot be captured (a retained forward)."""
    timed = {key: info for key, info in _d11_rows(bench_run[0]).items() if info["status"] == "ok"}
    assert timed
    for (impl, dtype, pass_), info in timed.items():
        assert info["launch_ms"] > 0 and info["host_bound"] == (info["launch_ms"] >= info["do_bench_ms"])
        if pass_ == "bwd":
            assert "graph_ms" not in info and "graph_error" not in info
        elif impl in GRAPHED_ON_H200:
            assert info.get("graph_ms", 0) > 0, (impl, dtype, pass_, info.get("graph_error"))
        else:  # plain and compiled PyTorch: a capture that fails is a finding the row names
            assert info.get("graph_ms", 0) > 0 or info.get("graph_error"), (impl, dtype, pass_)


def _check_shapes_rows(rows: list[dict]) -> None:
    """The attention-shapes rows of the CPU shape: every impl x pass, timed in 2 interleaved rounds, ours
    with ratios paired by round against each SDPA backend that ran (and CUDA-graph times on a GPU)."""
    by_key = {(r["impl"], r["pass_"]): r for r in rows}
    assert len(rows) == len(by_key) == 4 * 3
    timed = {impl for (impl, _), r in by_key.items() if r["status"] == "ok"}
    assert "flash_triton" in timed and "sdpa_flash" in timed  # both exist on every machine
    on_gpu = torch.cuda.is_available()
    for (impl, pass_), r in by_key.items():
        if impl not in timed:
            assert r["status"] == "unsupported" and r["reason"]
            continue
        assert r["do_bench_rounds"] == 2 and len(r["do_bench_round_ms"]) == 2
        assert r["do_bench_ms"] == pytest.approx(sum(r["do_bench_round_ms"]) / 2)
        assert r["check_rel_err"]["O"] < 2e-2
        assert ("graph_ms" in r) == (on_gpu and pass_ != "bwd")
        if impl == "flash_triton":
            for ref in timed - {"flash_triton"}:
                ours, theirs = r["do_bench_round_ms"], by_key[ref, pass_]["do_bench_round_ms"]
                paired = sorted(a / b for a, b in zip(ours, theirs, strict=True))
                assert r[f"ratio_to_{ref}"] == pytest.approx(sum(paired) / 2)
            assert r["best_sdpa"] in timed and "configs" in r and r["tune_seconds_so_far"] >= 0
