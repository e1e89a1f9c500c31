"""D26: the 8B configuration and the training step that composes the suite's pieces.

The distributed test trains a scaled-down model for 2 steps on 2 gloo ranks with every piece of the
suite (our FSDP with block units, per-block checkpointing, FlashAttention-2 and the fused LM-head loss
under the Triton interpreter, FusedAdamW on the shards) and checks it against one process training
the unsharded model with the same pieces on the whole batch.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.harness.settings import Settings
from cs336_systems.harness.step_8b import (
    combine_step_results,
    proxy_options,
    record_proxy_skip,
    run_proxy_row,
)
from cs336_systems.model import TransformerLM, get_preset
from cs336_systems.training.options import matmul_output_bytes, predicted_step_memory, without_triton
from cs336_systems.training.step_8b import (
    ABLATIONS,
    RECIPES,
    StepModel,
    StepOptions,
    build_meta_model,
    chunked_linear_cross_entropy,
    kernel_category,
    model_flops_per_step,
    recipe,
    run_step,
    step_checkpoint_policy,
)

# SPEC "2026 edition": the 8B configuration's parameter count and model FLOPs of one step.
PARAMS_8B = 8_125_698_048
FLOPS_8B = 4.74e15
# Scaled down: 2 blocks, d_head 16, vocab 64, context 16 (the Triton interpreter runs every kernel).
SMALL = dict(d_model=32, d_ff=64, num_layers=2, num_heads=2, vocab_size=64, context_length=16)


def small_options(**changes) -> StepOptions:
    base = dict(
        preset="tiny",
        model_changes=SMALL,
        compute_dtype="fp32",  # tight comparison: no bf16 rounding on either side
        warmup=0,
        steps=1,  # the first step + 1 timed = 2 optimizer steps
        lr=1e-3,
        return_params=True,
    )
    return StepOptions(**(base | changes))


def test_8b_preset_parameter_count_on_meta_device() -> None:
    config = get_preset("8B")
    assert (config.vocab_size, config.d_model, config.d_ff, config.num_layers, config.num_heads) == (
        151_936,
        4096,
        11_008,
        34,
        32,
    )
    assert config.d_head == 128 and config.context_length == 32_768
    model = TransformerLM(config, device="meta")
    assert all(p.is_meta for p in model.parameters()), "the count must not allocate"
    assert sum(p.numel() for p in model.parameters()) == PARAMS_8B


def test_8b_step_flops_match_spec() -> None:
    flops = model_flops_per_step(get_preset("8B"), batch=2, seq=32_768)
    assert flops == pytest.approx(FLOPS_8B, rel=2e-3)


def test_step_model_is_built_on_meta() -> None:
    model = build_meta_model(StepOptions())
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == PARAMS_8B  # the loss head is the LM head


def test_each_ablation_swaps_one_piece_of_ours() -> None:
    for swap, change in ABLATIONS.items():
        assert len(change) == 1, swap
        ((field, value),) = change.items()
        assert RECIPES["ours"][field] != value, swap
        recipe("ours", **change)  # a valid configuration


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(loss="logits"), "unknown loss"),
        (dict(fsdp="ddp"), "unknown fsdp"),
        (dict(optimizer="sgd"), "unknown optimizer"),
        (dict(checkpoint="every:0"), "'every:0' for the 8B step; expected .*keep:N"),
        (dict(checkpoint="sometimes"), "'sometimes' for the 8B step; expected .*keep:auto"),
        (dict(checkpoint="keep:-1"), "'keep:-1' for the 8B step"),
        (dict(checkpoint="every:2"), "'every:2' is not supported by the 8B step: it checkpoints each block"),
        (dict(checkpoint="nested"), "'nested' is not supported by the 8B step"),
        (dict(checkpoint="keep:auto", keep_budget_gib=0), "keep_budget_gib must be positive"),
    ],
)
def test_step_options_reject_unknown_choices(change: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        StepOptions(**change)


def test_chunked_loss_equals_full_cross_entropy(generator: torch.Generator) -> None:
    h = torch.randn(37, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    w = torch.randn(11, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    t = torch.randint(11, (37,), generator=generator)
    loss = chunked_linear_cross_entropy(h, w, t, chunk_tokens=8)  # 5 chunks, the last one short
    ref = F.cross_entropy(h @ w.T, t)
    torch.testing.assert_close(loss, ref.float(), rtol=1e-6, atol=1e-6)
    grads = torch.autograd.grad(loss, (h, w))
    ref_grads = torch.autograd.grad(ref, (h, w))
    for g, r in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(g, r, rtol=1e-6, atol=1e-7)


@pytest.mark.distributed
@pytest.mark.timeout(240)
@pytest.mark.parametrize("policy", ["every:1", "keep:1"])
def test_two_rank_step_with_our_pieces_equals_one_process(run_distributed, policy: str) -> None:
    # keep:1 on 2 ranks against every:1 in one process: the kept block changes nothing either
    ours = RECIPES["ours"]  # flash_triton, fused loss, FusedAdamW, +attn
    per_rank = run_distributed(
        run_step, 2, small_options(**(ours | dict(checkpoint=policy))), backend="gloo", timeout=180
    )
    single = run_step(small_options(**(ours | dict(fsdp="none", batch_per_rank=2, checkpoint="every:1"))))
    assert [r["kept_blocks"] for r in per_rank] == [int(policy == "keep:1")] * 2

    combined = combine_step_results(per_rank)
    assert len(combined["losses"]) == 2
    # Each rank's loss is the mean over its half of the batch: their mean is the whole batch's loss.
    torch.testing.assert_close(combined["losses"], single["losses"], rtol=1e-6, atol=1e-6)
    assert combined["losses"][1] < combined["losses"][0]  # it trains
    # Sharded: each rank holds about half of the model.
    total = sum(p.numel() for p in single["params"].values())
    assert max(r["local_params"] for r in per_rank) < 0.55 * total
    # After 2 AdamW steps the gathered parameters equal the single process's (lr 1e-3: a wrong or
    # missing gradient moves an element by ~1e-3).
    for rank_result in per_rank:
        assert rank_result["params"].keys() == single["params"].keys()
        for name, value in single["params"].items():
            torch.testing.assert_close(rank_result["params"][name], value, rtol=1e-5, atol=2e-6, msg=name)


def test_saving_attention_skips_its_rerun_and_changes_nothing(monkeypatch) -> None:
    from cs336_systems.kernels import flash

    calls = []
    forward = flash.AttentionPlan.forward
    monkeypatch.setattr(flash.AttentionPlan, "forward", lambda *a, **k: calls.append(1) or forward(*a, **k))
    runs = {}
    for save in (False, True):
        calls.clear()
        options = small_options(
            fsdp="none", attention="flash_triton", loss="chunked", optimizer="torch_fused"
        )
        runs[save] = run_step(dataclasses.replace(options, save_attention=save, steps=0))
        runs[save]["calls"] = len(calls)
    layers = SMALL["num_layers"]
    assert runs[False]["calls"] == 2 * layers  # forward, then the re-run in the backward
    assert runs[True]["calls"] == layers
    assert runs[True]["losses"] == runs[False]["losses"]
    for name, value in runs[False]["params"].items():
        torch.testing.assert_close(runs[True]["params"][name], value, rtol=0, atol=0, msg=name)


def full_layer_weights_alive_at_most(fsdps: list[str]) -> list[tuple[int, int]]:
    """Rank function: for each FSDP, shard the small model (meta -> this rank) and return (the most
    Linear/Embedding layers that held their full weight at once, the number of such layers)."""
    from cs336_systems.distributed.fsdp import is_sharded_layer
    from cs336_systems.training import sharding, step_model

    def local_shape(weight: torch.Tensor) -> tuple[int, ...]:
        return tuple(weight.to_local().shape if hasattr(weight, "to_local") else weight.shape)

    out = []
    materialize = sharding.materialize_
    for fsdp in fsdps:
        options = small_options(fsdp=fsdp)
        model = step_model.build_meta_model(options)
        layers = [m for m in model.modules() if is_sharded_layer(m)]
        full_shape = {id(m): tuple(m.weight.shape) for m in layers}
        most = 0

        def spy(*args, layers=layers, full_shape=full_shape, **kwargs) -> None:
            nonlocal most
            materialize(*args, **kwargs)
            full = [m for m in layers if not m.weight.is_meta and local_shape(m.weight) == full_shape[id(m)]]
            most = max(most, len(full))

        sharding.materialize_ = spy
        try:
            sharding.shard_model(model, options, torch.device("cpu"))
        finally:
            sharding.materialize_ = materialize
        out.append((most, len(layers)))
    return out


@pytest.mark.distributed
def test_materialization_holds_one_unit_at_a_time(run_distributed) -> None:
    # Ours materializes a layer right before cutting its shard; FSDP2 a whole unit (a block: 5 layers)
    # before fully_shard. Never the model: SMALL has 2 blocks of 5 + embedding + head = 12 layers.
    for per_fsdp in run_distributed(full_layer_weights_alive_at_most, 2, ["ours", "torch"], backend="gloo"):
        (ours, layers), (fsdp2, _) = per_fsdp
        assert layers == 5 * SMALL["num_layers"] + 2
        assert ours == 1
        assert fsdp2 == 5


@pytest.mark.parametrize(
    "kernel, category",
    [  # names from the 2 x H200 profile of the 8B step (docs/results/h200x2-leaderboard-2026.log)
        ("flash_bwd_dkdv_kernel", "attention"),
        ("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26_64x64x128", "attention"),
        ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
        ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
        ("_adamw_kernel", "optimizer"),
        ("_cross_entropy_rows_kernel", "loss"),
        ("triton_poi_fused__unsafe_view_mul_silu_3", "triton (compiled elementwise)"),
        ("void at::native::elementwise_kernel<128, 4>", "other"),
    ],
)
def test_kernel_categories(kernel: str, category: str) -> None:
    assert kernel_category(kernel) == category


@pytest.mark.parametrize("policy, kept", [("none", 2), ("keep:1", 1), ("keep:2", 2), ("keep:0", 0)])
def test_keep_trains_as_every_block_checkpointed(policy: str, kept: int) -> None:
    base = small_options(fsdp="none", loss="chunked", optimizer="torch_fused")
    ref = run_step(dataclasses.replace(base, checkpoint="every:1"))
    run = run_step(dataclasses.replace(base, checkpoint=policy))
    assert run["kept_blocks"] == kept and ref["kept_blocks"] == 0
    assert run["losses"] == pytest.approx(ref["losses"], rel=1e-6)
    for name, value in ref["params"].items():
        torch.testing.assert_close(run["params"][name], value, rtol=1e-6, atol=1e-7, msg=name)


@pytest.mark.parametrize("save_attention", [True, False])
def test_keep_skips_the_last_blocks_rerun(save_attention: bool) -> None:
    """keep:N re-runs the first L - N blocks in backward and not the last N: count each block's
    QKV projection calls (its forward, plus one per re-run)."""
    layers = 4
    options = small_options(
        fsdp="none",
        loss="chunked",
        checkpoint="keep:1",
        save_attention=save_attention,
        model_changes=SMALL | dict(num_layers=layers),
    )
    torch.manual_seed(0)
    model = StepModel(options.model_config(), options)
    calls = [0] * layers
    for i, block in enumerate(model.layers):
        block.attn.qkv_proj.register_forward_pre_hook(lambda m, a, i=i: calls.__setitem__(i, calls[i] + 1))
    tokens = torch.randint(SMALL["vocab_size"], (1, SMALL["context_length"]))
    model(tokens, tokens).backward()
    assert calls == [2, 2, 2, 1]


def test_keep_auto_resolves_from_the_budget() -> None:
    # 8B, 2 GPUs, 32,768 tokens each: the accounting's closed form (tests/test_checkpointing.py)
    compiled = StepOptions(compile=True, checkpoint="keep:auto", keep_budget_gib=124)
    assert step_checkpoint_policy(compiled, world_size=2) == "keep:14"
    assert step_checkpoint_policy(dataclasses.replace(compiled, keep_budget_gib=60), 2) == "keep:0"
    assert step_checkpoint_policy(dataclasses.replace(compiled, keep_budget_gib=1e6), 2) == "keep:34"
    assert step_checkpoint_policy(dataclasses.replace(compiled, checkpoint="keep:3"), 2) == "keep:3"


# -- the CLI on a CPU (issue 38, friction 1): a new user's first command --------------------------------

REPO = Path(__file__).resolve().parents[1]
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback: only without CUDA")


def run_train_8b(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """The CLI as a new user runs it: a fresh process, no TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    cmd = [sys.executable, "-m", "cs336_systems.cli.train_8b", *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@NO_CUDA
def test_cli_tiny_preset_runs_on_cpu_with_torch_pieces() -> None:
    proc = run_train_8b("--fsdp", "none", "--preset", "tiny", "--warmup", "0", "--steps", "2")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert re.search(r"step s \(median[^:]*: \d+\.\d+", proc.stdout), proc.stdout
    assert "attn=sdpa loss=chunked opt=torch_fused" in proc.stdout  # what ran, on the summary's first line
    notes = [line for line in proc.stderr.splitlines() if line.startswith("no CUDA")]
    assert len(notes) == 1 and "--attention sdpa" in notes[0] and "TRITON_INTERPRET=1" in notes[0]
    steps = re.findall(r"step (\d)/3 \((first|warm-up|timed)\) \d+\.\d+ s, loss", proc.stderr)
    assert steps == [("1", "first"), ("2", "timed"), ("3", "timed")], proc.stderr


@NO_CUDA
@pytest.mark.parametrize("flag", [("--attention", "flash_triton"), ("--loss", "fused")])
def test_cli_triton_piece_on_cpu_fails_in_one_line(flag: tuple[str, str]) -> None:
    proc = run_train_8b("--fsdp", "none", "--preset", "tiny", *flag, timeout=60)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert (
        " ".join(flag) in proc.stderr
        and "--attention sdpa --loss chunked --optimizer torch_fused" in proc.stderr
    )


def test_without_triton_swaps_only_the_triton_pieces() -> None:
    options, swaps = without_triton(recipe("ours", attention="sdpa"))
    assert swaps == {"loss": "chunked", "optimizer": "torch_fused"}
    assert (options.attention, options.loss, options.optimizer, options.fsdp) == (
        "sdpa", "chunked", "torch_fused", "ours"
    )  # fmt: skip
    assert without_triton(recipe("torch"))[1] == {}


# -- the 8B per-GPU proxy (issue 37) ---------------------------------------------------------------------


def test_proxy_options_follow_the_two_gpu_checkpointing() -> None:
    s = Settings(step8b_proxy_layers=2, step8b_proxy_steps=2, step8b_keep_budget_gib=112)  # seq 32,768
    torch_, ours = proxy_options("torch", s), proxy_options("ours", s)
    for options in (torch_, ours):
        assert (options.fsdp, options.compile, options.batch_per_rank, options.sequence_length) == (
            "none", True, 1, 32768
        )  # fmt: skip
        assert options.model_config().num_layers == 2 and options.model_config().d_model == 4096
    assert torch_.checkpoint == "every:1" and torch_.attention == "sdpa"
    # Under 112 GiB the two-GPU 8B step keeps 11 of its 34 blocks: the proxy keeps round(2 * 11 / 34) = 1.
    assert (
        step_checkpoint_policy(recipe("ours", compile=True, keep_budget_gib=112, checkpoint="keep:auto"), 2)
        == "keep:11"
    )
    assert ours.checkpoint == "keep:1"
    assert proxy_options("sdpa", s).attention == "sdpa" and proxy_options("sdpa", s).checkpoint == "keep:1"
    # A budget the two-GPU step cannot keep a block in: every block checkpointed here too.
    assert proxy_options("ours", dataclasses.replace(s, step8b_keep_budget_gib=64)).checkpoint == "keep:0"
    # Plenty of budget for both: all the proxy's blocks kept, never more than it has.
    assert proxy_options("ours", dataclasses.replace(s, step8b_keep_budget_gib=10_000)).checkpoint == "keep:2"
    with pytest.raises(ValueError, match="unknown proxy row"):
        proxy_options("nope", s)


def test_proxy_rows_through_spawned_steps_into_the_report(tmp_path) -> None:
    """The proxy's path on a CPU, scaled down: each row a spawned one-process step (fsdp none inside a
    process group of one), recorded as the bench records it, then the report's section with its ratio."""
    from cs336_systems.harness.record import Recorder
    from cs336_systems.report import write_report
    from cs336_systems.rows.schema import tag

    small = dict(model_changes=SMALL, seq_len=16, compile=False, compute_dtype="fp32", warmup=0, steps=2)
    measured: dict = {}
    rows, results = [], {}
    for row, changes in (
        ("torch", {}),
        ("ours", dict(attention="sdpa", loss="chunked", optimizer="torch_fused")),
    ):
        options = dataclasses.replace(proxy_options(row, Settings()), preset="tiny", **small, **changes)
        bench = Recorder()
        tag(bench, "proxy_8b")
        results[row] = run_proxy_row(bench, row, options, 120, measured)
        stats = {"mean": sum(bench.stats) / len(bench.stats), "rounds": len(bench.stats)}
        rows.append({"group": bench.group, "name": f"test_8b_proxy[{row}]", "params": {"row": row},
                     "extra_info": bench.extra_info, "stats": stats})  # fmt: skip
    ratio = results["ours"]["step_s"] / results["torch"]["step_s"]
    ours_info = rows[1]["extra_info"]
    assert (
        ours_info["vs_torch"] == pytest.approx(ratio) and ours_info["checkpoint_resolved"] == "keep:1"
    )  # 112 GiB: CPU
    assert set(ours_info) >= {"step_s", "first_step_s", "first_step_vs_torch_s", "details", "kept_blocks"}
    assert "tokens_per_rank" in ours_info["details"] and "tokens_per_rank" not in ours_info
    path = tmp_path / "proxy.json"
    path.write_text(json.dumps({"benchmarks": rows, "machine_info": {}, "commit_info": {}}, default=str))
    writeup = tmp_path / "report" / "writeup.md"
    write_report([path], tmp_path / "report")
    text = writeup.read_text()
    assert "D26 8B per-GPU proxy" in text
    # On a loaded machine the spawned steps' rounds may disagree: then the ratio is withheld, saying why.
    assert f"ours / torch step time: {ratio:.3f}×" in text or "ours / torch: not derived:" in text, text[
        -2000:
    ]


def test_a_skipped_proxy_row_names_what_it_would_have_run() -> None:
    # A row the group's budget left out must still say its batch, sequence, layers and pieces, or the
    # table shows a row of dashes.
    from cs336_systems.harness.record import Recorder

    bench = Recorder()
    options = proxy_options("sdpa", Settings(step8b_proxy_layers=2, step8b_keep_budget_gib=112))
    record_proxy_skip(bench, "sdpa", options, "the group's budget was spent")
    info = bench.extra_info
    assert info["status"] == "skipped" and info["reason"] == "the group's budget was spent"
    assert (info["row"], info["batch"], info["seq"], info["layers"]) == ("sdpa", 1, 32768, 2)
    assert info["pieces"]["attention"] == "sdpa" and info["checkpoint_resolved"] == "keep:1"


def _mm_calls_in_backward(options: StepOptions) -> tuple[int, dict[str, torch.Tensor]]:
    """Matmuls the backward of one step runs (its own and the checkpointed blocks' re-runs), and the
    gradients."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
                CountMatmuls.calls += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = StepModel(options.model_config(), options)
    tokens = torch.randint(SMALL["vocab_size"], (1, SMALL["context_length"]), generator=torch.Generator())
    loss = model(tokens, tokens)
    with CountMatmuls():
        loss.backward()
    return CountMatmuls.calls, {n: p.grad for n, p in model.named_parameters()}


def test_save_matmuls_skips_the_rerun_matmuls_and_changes_nothing() -> None:
    """With ``save_matmuls`` the re-run of a checkpointed block recomputes no matmul (the backward runs
    as many as without checkpointing), and the gradients are bit-identical."""
    base = small_options(fsdp="none", attention="sdpa", loss="full", checkpoint="every:1")
    plain_calls, plain_grads = _mm_calls_in_backward(base)
    saved_calls, saved_grads = _mm_calls_in_backward(dataclasses.replace(base, save_matmuls=True))
    unchecked_calls, _ = _mm_calls_in_backward(dataclasses.replace(base, checkpoint="none"))
    assert saved_calls == unchecked_calls < plain_calls
    for name, grad in plain_grads.items():
        torch.testing.assert_close(saved_grads[name], grad, rtol=0, atol=0, msg=name)
    # and the planner counts their outputs into a checkpointed block's memory
    with_mm = dataclasses.replace(base, save_matmuls=True)
    extra = predicted_step_memory(with_mm, 1).checkpointed - predicted_step_memory(base, 1).checkpointed
    assert extra == matmul_output_bytes(base.model_config(), base.sequence_length) > 0


def test_progress_lines(capsys) -> None:
    """A line per step; inside an untimed step, forward and backward are said only once it is slow."""
    import time

    from cs336_systems.training.step_8b import Progress

    progress = Progress(small_options(progress=True, warmup=1, steps=1), time.perf_counter())
    progress.begin("built")
    progress.phase("forward")  # quick: nothing
    progress.SLOW_STEP_S = 0.0  # this instance only: every step counts as slow
    progress.phase("start")
    progress.phase("forward")
    progress.phase("synced")
    progress.step("first", 1.5)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("] ", 1)[1].split(" after")[0] for line in lines[:3]] == [
        "built",
        "step 1/3: forward done",
        "step 1/3: backward done",
    ]
    assert re.search(r"step 1/3 \(first\) \d+\.\d{3} s, loss 1.5000$", lines[3])
    quiet = Progress(small_options(), time.perf_counter())  # progress off: silent
    quiet.step("first", 1.0)
    assert capsys.readouterr().err == ""
