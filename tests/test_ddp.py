"""D14-D17: every DDP variant trains to the same weights as one process on the whole batch.

CPU + gloo, 2 and 4 ranks, float64 toy models (``tests/helpers/toy.py``) with a frozen
layer, a buffer, tied weights and a layer that some steps leave without a gradient; SGD with
momentum and AdamW; several bucket sizes; ``zero_grad`` in both styles. The overlapping wrappers
are driven through the grading hooks of ``tests/adapters.py``. Spawning ranks costs seconds here,
so one spawn runs many cases and returns all results; the assertions run in the parent.
"""

from __future__ import annotations

import gzip
import itertools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.comm import shard_batch
from cs336_systems.distributed.ddp_bucketed import DDPBucketed, assign_buckets
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.naive_ddp import NaiveDDP

from . import adapters
from .helpers.toy import (
    EquivalenceCase,
    ToyModel,
    compare_with_single_process,
    make_model,
)

TOL = 1e-10  # float64


def _run_case(case: EquivalenceCase) -> dict:
    """One case, with the individual / bucketed wrappers built and driven by the adapters."""
    if case.variant == "individual":
        return compare_with_single_process(
            case,
            wrap_fn=adapters.get_ddp_individual_parameters,
            after_backward=adapters.ddp_individual_parameters_on_after_backward,
        )
    if case.variant == "bucketed":
        return compare_with_single_process(
            case,
            wrap_fn=lambda m: adapters.get_ddp_bucketed(m, bucket_size_mb=case.bucket_mb),
            after_backward=adapters.ddp_bucketed_on_after_backward,
            batch_start=adapters.ddp_bucketed_on_train_batch_start,
        )
    return compare_with_single_process(case)


def _second_backward_error(variant: str) -> str:
    """A second backward before finish_gradient_synchronization must raise, naming the parameter."""
    model = make_model("toy", seed=0)
    ddp = DDPIndividualParameters(model) if variant == "individual" else DDPBucketed(model, 0.0001)
    x, mask = torch.randn(2, 10, dtype=torch.float64), torch.ones(2, dtype=torch.bool)
    ddp(x, mask).sum().backward()
    try:
        ddp(x, mask).sum().backward()
    except RuntimeError as exc:
        return str(exc)
    finally:
        dist.barrier()
    return "no error"


def _suite(cases: list[EquivalenceCase], with_errors: bool) -> dict:
    results = {"cases": [_run_case(case) for case in cases]}
    if with_errors:
        results["errors"] = {v: _second_backward_error(v) for v in ("individual", "bucketed")}
    return results


def _cases_ws2() -> list[EquivalenceCase]:
    variants = [("naive", None), ("flat", None), ("individual", None)]
    variants += [("bucketed", b) for b in (0.0001, 0.001, 100.0)]  # 1 param/bucket, a few, all in one
    cases = []
    for (variant, bucket), optimizer, model in itertools.product(variants, ("sgd", "adamw"), ("toy", "tied")):
        set_to_none = len(cases) % 2 == 0  # alternate the zero_grad styles
        cases.append(EquivalenceCase(model, variant, bucket, optimizer, set_to_none))
    # `extra` unused by every rank: its grad must stay None (AdamW must not decay it).
    for variant, bucket in variants:
        cases.append(EquivalenceCase("toy", variant, bucket, "adamw", True, extra="none"))
    # `extra` used by rank 0 only: the bucketed wrapper must still average it over all ranks.
    for bucket, set_to_none, model in itertools.product((0.0001, 100.0), (True, False), ("toy", "tied")):
        cases.append(EquivalenceCase(model, "bucketed", bucket, "adamw", set_to_none, extra="rank0"))
    return cases


def _cases_ws4() -> list[EquivalenceCase]:
    cases = [EquivalenceCase("toy", v, None, "adamw") for v in ("naive", "flat", "individual")]
    cases += [EquivalenceCase("tied", "bucketed", b, "sgd", b < 1) for b in (0.001, 100.0)]
    cases.append(EquivalenceCase("toy", "bucketed", 0.0001, "adamw", extra="rank0"))
    return cases


def _check(per_rank: list[dict], cases: list[EquivalenceCase]) -> None:
    for i, case in enumerate(cases):
        results = [r["cases"][i] for r in per_rank]
        for rank, result in enumerate(results):
            assert result["init_diff"] == 0, f"{case}: rank {rank} did not start from rank 0's weights"
            assert result["diff"] < TOL, f"{case}: rank {rank} is {result['diff']:.3g} from single-process"
            assert result["grads_none_match"], f"{case}: rank {rank} has grads where single-process has None"
            assert torch.equal(result["params"], results[0]["params"]), f"{case}: ranks 0 and {rank} differ"


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ddp_variants_match_single_process_2_ranks(run_distributed) -> None:
    cases = _cases_ws2()
    per_rank = run_distributed(_suite, 2, cases, True, backend="gloo", timeout=150)
    _check(per_rank, cases)
    buckets = {
        c.bucket_mb: r["num_buckets"]
        for c, r in zip(cases, per_rank[0]["cases"], strict=True)
        if c.model == "toy"
    }
    assert buckets[0.0001] == 8  # every trainable toy tensor (fc1, ln, fc2, extra: weight + bias) alone
    assert 1 < buckets[0.001] < 8
    assert buckets[100.0] == 1
    for message in per_rank[0]["errors"].values():
        assert re.search(r"parameter '(fc1|ln|fc2|extra)\.\w+' got a second gradient", message), message


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_ddp_variants_match_single_process_4_ranks(run_distributed) -> None:
    cases = _cases_ws4()
    per_rank = run_distributed(_suite, 4, cases, False, backend="gloo", timeout=150)
    _check(per_rank, cases)


@pytest.mark.gpu(2)
@pytest.mark.distributed
@pytest.mark.timeout(300)
def test_ddp_variants_match_single_process_nccl(run_distributed) -> None:
    """The same checks on GPUs with nccl: the hooks, streams and async waits of the CUDA path."""
    cases = _cases_ws2()
    per_rank = run_distributed(_suite, 2, cases, False, backend="nccl", timeout=240)
    _check(per_rank, cases)


# -- the training driver of the benches, on the tiny LM ----------------------------------------------


def _lm_driver_suite() -> dict:
    from cs336_systems.harness.train_step import TrainCase as Case
    from cs336_systems.harness.train_step import TrainSetup, run_cases

    setup = TrainSetup(preset="tiny", context_length=16, global_batch=4, warmup=1, steps=2)
    cases = [
        Case("local"),
        Case("naive"),
        Case("flat"),
        Case("individual"),
        Case("bucketed", 1),
        Case("torch_ddp", 1),
        Case("bucketed", 1, "sharded"),
        Case("bucketed", 1, "zero"),
    ]
    out = run_cases(setup, cases)
    out["profiled"] = run_cases(
        TrainSetup(preset="tiny", context_length=16, warmup=1, steps=1, profile_steps=1), [Case("individual")]
    )
    try:
        run_cases(TrainSetup(preset="tiny", global_batch=3), [Case("naive")])
    except ValueError as exc:
        out["uneven"] = str(exc)
    out["lm"] = _lm_matches_single_process()
    return out


def _lm_matches_single_process() -> float:
    """The tiny LM, bucketed DDP (1 MB) + AdamW vs one process on the whole batch, fp32."""
    from cs336_systems.model import TransformerLM, cross_entropy, get_preset

    rank, world_size = dist.get_rank(), dist.get_world_size()
    config = get_preset("tiny")
    torch.manual_seed(0)
    reference = TransformerLM(config)
    torch.manual_seed(rank)  # other ranks start elsewhere: the broadcast must fix that
    ddp = DDPBucketed(TransformerLM(config), bucket_size_mb=1)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    for step in range(2):
        tokens = torch.randint(config.vocab_size, (4, 17), generator=torch.Generator().manual_seed(step))
        opt_ref.zero_grad()
        cross_entropy(reference(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt_ref.step()
        opt.zero_grad()
        ddp.on_train_batch_start()
        mine = shard_batch(tokens, rank, world_size)
        cross_entropy(ddp(mine[:, :-1]), mine[:, 1:]).backward()
        ddp.finish_gradient_synchronization()
        opt.step()
    return max(
        (a - b).abs().max().item() for a, b in zip(ddp.parameters(), reference.parameters(), strict=True)
    )


@pytest.mark.distributed
@pytest.mark.timeout(240)
def test_lm_and_bench_driver_on_gloo(run_distributed) -> None:
    per_rank = run_distributed(_lm_driver_suite, 2, backend="gloo", timeout=200)
    results = per_rank[0]
    assert max(r["lm"] for r in per_rank) < 1e-5
    assert "does not divide the batch size 3" in results["uneven"]
    for key in (
        "local",
        "naive",
        "flat",
        "individual",
        "bucketed-1MB",
        "torch_ddp-1MB",
        "bucketed-1MB-sharded",
    ):
        r = results[key]
        assert not r["oom"] and len(r["step_ms"]) == 2 and min(r["step_ms"]) > 0, key
        assert (r["comm_ms"] is None) == (key in ("local", "torch_ddp-1MB")), key
    assert results["bucketed-1MB"]["num_buckets"] > 1
    # Sharding halves the optimizer state (the tiny LM's two big matrices land on different ranks).
    full = results["bucketed-1MB"]["optim_state_mib"]
    for key in ("bucketed-1MB-sharded", "bucketed-1MB-zero"):
        shares = [r[key]["optim_state_mib"] / full for r in per_rank]
        assert max(shares) < 0.55 and abs(sum(shares) - 1) < 0.01, (key, shares)
    profiled = results["profiled"]["individual"]
    assert profiled["overlap_share"] is None and profiled["comm_kernel_ms"] == 0  # no device kernels on CPU


@pytest.mark.distributed
@pytest.mark.timeout(180)
def test_torchrun_entry_points_start_their_own_ranks(reaped) -> None:
    """``cli.ddp_train`` and ``cli.allreduce`` (torchrun's entry points) start gloo ranks themselves
    without torchrun: the DDP step prints its JSON, the all-reduce its table row."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}

    def run(*args: str) -> str:
        proc = subprocess.run(
            [sys.executable, "-m", *args], env=env, capture_output=True, text=True, timeout=150
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        return proc.stdout

    out = run(
        "cs336_systems.cli.ddp_train",
        "--nproc",
        "2",
        "--preset",
        "tiny",
        "--ctx",
        "32",
        "--variant",
        "bucketed",
    )
    result = json.loads(out[out.index("{") :])
    assert result["case"].startswith("bucketed") and result["comm_share"] > 0, result
    row = run(
        "cs336_systems.cli.allreduce", "--nproc", "2", "--backend", "gloo", "--sizes", "1MB"
    ).splitlines()[-1]
    assert row.split()[:3] == ["gloo", "2", "1048576"], row


# -- single-process checks -------------------------------------------------------------------------


def test_buckets_reverse_order_cap_and_big_params() -> None:
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (10, 300, 20, 30, 40)]  # fp32: 4 bytes each
    cap_mb = 200 * 4 / 2**20  # 200 elements
    buckets = assign_buckets(params, cap_mb)
    assert [[p.numel() for p in b.params] for b in buckets] == [[40, 30, 20], [300], [10]]
    assert [b.numel for b in buckets] == [90, 300, 10]
    mixed = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    assert len(assign_buckets(mixed, 100.0)) == 2  # one flat buffer cannot hold two dtypes
    with pytest.raises(ValueError, match="bucket_size_mb must be positive"):
        assign_buckets(params, 0)


def test_uneven_batch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="world size 4 does not divide the batch size 6"):
        shard_batch(torch.zeros(6, 3), 0, 4)
    assert shard_batch(torch.arange(6), 2, 3).tolist() == [4, 5]


@pytest.mark.parametrize("wrapper", [NaiveDDP, DDPIndividualParameters, lambda m: DDPBucketed(m, 1.0)])
def test_wrappers_need_a_process_group(wrapper) -> None:
    with pytest.raises(RuntimeError, match="initialized process group"):
        wrapper(ToyModel())


def test_flat_chunks_keep_order_dtype_and_cap() -> None:
    from cs336_systems.distributed.comm import flat_chunks

    a, b, c = torch.zeros(100), torch.zeros(100), torch.zeros(300)  # 400, 400, 1200 bytes
    d = torch.zeros(10, dtype=torch.float64)
    chunks = flat_chunks([a, b, d, c], chunk_mb=900 / 2**20)
    assert [[t.numel() for t in chunk] for chunk in chunks] == [[100, 100], [300], [10]]
    assert all(len({t.dtype for t in chunk}) == 1 for chunk in chunks)


def test_overlap_share_from_a_trace(tmp_path: Path) -> None:
    from cs336_systems.distributed.overlap import load_trace, overlap_stats

    def kernel(name: str, ts: float, dur: float, cat: str = "kernel") -> dict:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    trace = {
        "traceEvents": [
            kernel("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 0, 100),  # 40 us of it under compute
            kernel("ampere_sgemm_128x64_nn", 20, 30),
            kernel("elementwise_kernel", 40, 20),  # overlaps the gemm: counted once
            kernel("ncclKernel_AllReduce", 200, 100),  # fully exposed
            kernel("Memcpy DtoD", 250, 50, cat="gpu_memcpy"),  # neither comm nor compute
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},
        ]
    }
    stats = overlap_stats(trace, steps=2)
    assert stats["overlap_share"] == pytest.approx(40 / 200)
    assert stats["comm_kernel_ms"] == pytest.approx(200 / 1e3 / 2)
    assert stats["compute_kernel_ms"] == pytest.approx(40 / 1e3 / 2)
    assert overlap_stats({"traceEvents": [kernel("gemm", 0, 5)]})["overlap_share"] is None
    path = tmp_path / "t.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(trace, f)
    assert load_trace(path) == trace


def test_record_times_become_the_benchmark_rounds(tmp_path: Path) -> None:
    """In a real pytest-benchmark session (a subprocess: the outer run may have benchmarks disabled
    by xdist), the recorded per-step times are the JSON's rounds and stats."""
    (tmp_path / "test_replay.py").write_text(
        "from cs336_systems.harness.record import record_times\n"
        "def test_case(benchmark):\n"
        "    record_times(benchmark, [1.0, 2.0, 6.0], mean_ms=3.0)\n"
    )
    out = tmp_path / "out.json"
    # Not the outer run's xdist worker variables: pytest-benchmark would then skip writing the JSON.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            f"--rootdir={tmp_path}",
            f"--benchmark-json={out}",
            str(tmp_path / "test_replay.py"),
        ],
        cwd=tmp_path,
        env=env,
        check=True,
        capture_output=True,
        timeout=120,
    )
    bench = json.loads(out.read_text())["benchmarks"][0]
    assert bench["stats"]["rounds"] == 3
    assert bench["stats"]["mean"] == pytest.approx(0.003) and bench["stats"]["max"] == pytest.approx(0.006)
    assert bench["extra_info"]["mean_ms"] == 3.0
