"""Activation checkpointing in the model (ModelConfig.checkpoint) and the fused loss through the model:
same loss and gradients as without, under every attention choice and under torch.compile; Linear
forward pre-hooks (FSDP's gathers) fire again during recomputation, as often as the accounting allows;
parameter names and counts do not change. Also the D22(a) accounting against hand numbers."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from cs336_systems.accounting import checkpointing as acc
from cs336_systems.attention import attention_names
from cs336_systems.model import ModelConfig, TransformerLM, count_parameters, cross_entropy, get_preset
from cs336_systems.model.checkpointing import checkpointed_blocks, parse_checkpoint, run_blocks
from cs336_systems.model.transformer import Linear, LMHead
from cs336_systems.units import GIB

CFG = ModelConfig(d_model=32, d_ff=64, num_layers=5, num_heads=2, vocab_size=50, context_length=16)
POLICIES = ["every:1", "every:2", "every:3", "every:8", "nested", "keep:0", "keep:2", "keep:9"]


def _loss_and_grads(config: ModelConfig, ids, targets, compile_backend: str | None = None):
    torch.manual_seed(0)
    model = TransformerLM(config, device=ids.device)
    fn = torch.compile(model, backend=compile_backend) if compile_backend else model
    loss = fn(ids, targets)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _batch(gen: torch.Generator):
    ids = torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)
    return ids, torch.randint(0, CFG.vocab_size, (2, 16), generator=gen)


def _assert_same(a, b, tol: float = 1e-6) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=tol, atol=tol)
    assert a[1].keys() == b[1].keys()
    for name in a[1]:
        torch.testing.assert_close(a[1][name], b[1][name], rtol=tol, atol=tol, msg=name)


@pytest.mark.parametrize("policy", ["none", "every:1", "every:12", "nested", "keep:0", "keep:7"])
def test_parse_valid(policy: str) -> None:
    kind, k = parse_checkpoint(policy)
    assert kind == policy.split(":")[0] and k == (int(policy.split(":")[1]) if ":" in policy else 0)
    assert ModelConfig(64, 128, 2, 4, checkpoint=policy).checkpoint == policy


@pytest.mark.parametrize(
    "policy",
    [
        "every:0",
        "every:",
        "every:x",
        "every:-1",
        "all",
        "every:2 ",
        "Nested",
        "keep:",
        "keep:-1",
        "keep:auto",
    ],
)
def test_parse_invalid(policy: str) -> None:
    # the message names the policy and the grammar, keep:N included
    with pytest.raises(ValueError, match=rf"{re.escape(repr(policy))}.*every:K.*keep:N"):
        ModelConfig(64, 128, 2, 4, checkpoint=policy)


@pytest.mark.parametrize(
    "policy, expected",
    [
        ("none", [False] * 4),
        ("every:1", [True] * 4),
        ("keep:0", [True] * 4),
        ("keep:1", [True, True, True, False]),  # the last block plain, not the first
        ("keep:3", [True, False, False, False]),
        ("keep:4", [False] * 4),
        ("keep:9", [False] * 4),
    ],
)
def test_checkpointed_blocks(policy: str, expected: list[bool]) -> None:
    assert checkpointed_blocks(policy, 4) == expected


@pytest.mark.parametrize("policy", ["every:2", "nested"])
def test_checkpointed_blocks_refuses_segments(policy: str) -> None:
    with pytest.raises(ValueError, match=rf"{re.escape(repr(policy))} is not per-block"):
        checkpointed_blocks(policy, 4)


@pytest.mark.parametrize("policy", POLICIES)
def test_same_loss_and_grads(policy: str, generator) -> None:
    ids, targets = _batch(generator)
    _assert_same(
        _loss_and_grads(CFG.with_(checkpoint=policy), ids, targets), _loss_and_grads(CFG, ids, targets)
    )


@pytest.mark.parametrize("attention", [a for a in attention_names() if a != "pytorch"])
def test_every_attention(attention: str, generator) -> None:
    ids, targets = _batch(generator)
    config = CFG.with_(attention=attention, num_layers=2)
    _assert_same(
        _loss_and_grads(config.with_(checkpoint="every:1"), ids, targets),
        _loss_and_grads(config, ids, targets),
        tol=1e-5,
    )


def test_compiled(device, generator) -> None:
    # the whole model under torch.compile (aot_eager: the CPU has no compiler to spare) with nested
    # checkpoints inside it (single-level ones are a special case) and the fused loss's graph break;
    # on the device fixture, as the fused loss's Triton kernel runs on the CPU only under the interpreter
    policy = "nested"
    ids, targets = (t.to(device) for t in _batch(generator))
    config = CFG.with_(num_layers=3, fused_loss=True)
    torch._dynamo.reset()
    compiled = _loss_and_grads(config.with_(checkpoint=policy), ids, targets, compile_backend="aot_eager")
    _assert_same(compiled, _loss_and_grads(CFG.with_(num_layers=3), ids, targets), tol=1e-5)


@pytest.mark.parametrize("n_blocks", [4, 5, 8])
@pytest.mark.parametrize("policy", ["none", "every:1", "every:3", "nested", "keep:2"])
def test_prehooks_fire_on_recompute(policy: str, n_blocks: int, generator) -> None:
    """FSDP gathers weights in Linear forward pre-hooks: recomputation must call them again. Every
    single-level policy recomputes each block once; nested recomputes within the accounting's bound."""
    torch.manual_seed(0)
    model = TransformerLM(CFG.with_(num_layers=n_blocks, checkpoint=policy))
    calls: dict[int, int] = {}
    for i, block in enumerate(model.layers):
        for m in block.modules():
            if isinstance(m, Linear):
                m.register_forward_pre_hook(lambda mod, args, i=i: calls.__setitem__(i, calls.get(i, 0) + 1))
    ids, targets = _batch(generator)
    model(ids, targets).backward()
    per_block = [calls[i] // 5 for i in range(n_blocks)]  # 5 Linears per block, each called as often
    assert all(calls[i] % 5 == 0 for i in range(n_blocks))
    if policy == "none":
        assert per_block == [1] * n_blocks
    elif policy.startswith("every"):
        assert per_block == [2] * n_blocks
    elif policy == "keep:2":  # the first n - 2 blocks re-run once, the last two never
        assert per_block == [2] * (n_blocks - 2) + [1, 1]
    else:
        extra = sum(per_block) - n_blocks
        assert min(per_block) >= 2 and n_blocks < extra <= acc.nested_recompute_count(n_blocks)


def _recompute_runs(policy: str, n_blocks: int, generator) -> list[list[int]]:
    """The blocks whose forwards the backward re-runs, grouped into runs that happen back to back
    (no block's own backward in between): one run per checkpointed segment, in backward order."""
    torch.manual_seed(0)
    model = TransformerLM(CFG.with_(num_layers=n_blocks, checkpoint=policy))
    events: list[tuple[str, int]] = []

    def pre_hook(module, args, i: int) -> None:
        if torch._C._current_graph_task_id() != -1:  # a forward inside the backward: a recompute
            events.append(("recompute", i))

    def post_hook(module, args, out, i: int) -> None:
        if torch._C._current_graph_task_id() == -1:  # the block's backward begins with this grad
            out.register_hook(lambda grad: events.append(("backward", i)))

    for i, block in enumerate(model.layers):
        block.register_forward_pre_hook(lambda m, a, i=i: pre_hook(m, a, i))
        block.register_forward_hook(lambda m, a, o, i=i: post_hook(m, a, o, i))
    ids, targets = _batch(generator)
    model(ids, targets).backward()
    runs: list[list[int]] = []
    for (kind, i), prev in zip(events, [("", -1), *events], strict=False):
        if kind == "recompute":
            if prev[0] == "recompute":
                runs[-1].append(i)
            else:
                runs.append([i])
    return runs


@pytest.mark.parametrize("n_blocks, k", [(5, 2), (6, 3), (4, 4), (5, 1), (3, 8)])
def test_every_k_recomputes_segments_of_k(n_blocks: int, k: int, generator) -> None:
    """``every:K`` checkpoints segments of K consecutive blocks: the backward re-runs each segment's
    blocks together (the last segment first), so a segment's K blocks' activations are live at once
    and only the segment inputs are stored in between. What ``run_blocks`` does must match
    ``accounting.checkpointing.single_level``: ceil(N/K) stored inputs (segments), K live blocks,
    N recomputed forwards. A policy that ignores K (one block per segment) must fail this."""
    runs = _recompute_runs(f"every:{k}", n_blocks, generator)
    segments = [list(range(s, min(s + k, n_blocks))) for s in range(0, n_blocks, k)]
    assert runs == segments[::-1]
    plan = acc.single_level(n_blocks, k)
    assert len(runs) == plan.stored_inputs
    assert max(len(r) for r in runs) == plan.live_blocks
    assert sum(len(r) for r in runs) == plan.extra_block_forwards


def test_no_checkpoint_without_grad(generator) -> None:
    blocks = [torch.nn.Linear(4, 4) for _ in range(3)]
    calls = []
    for b in blocks:
        b.register_forward_pre_hook(lambda *a: calls.append(1))
    with torch.no_grad():
        run_blocks(blocks, torch.randn(2, 4, generator=generator), "nested")
    assert len(calls) == 3


def test_fused_loss_in_model(device, generator) -> None:
    ids, targets = (t.to(device) for t in _batch(generator))
    fused = _loss_and_grads(CFG.with_(fused_loss=True), ids, targets)
    _assert_same(fused, _loss_and_grads(CFG, ids, targets), tol=1e-5)
    torch.manual_seed(0)
    model = TransformerLM(CFG.with_(fused_loss=True), device=device)
    logits = model(ids)  # without targets: logits, as before
    assert logits.shape == (2, 16, CFG.vocab_size)
    torch.testing.assert_close(model(ids, targets), cross_entropy(logits, targets), rtol=1e-5, atol=1e-5)


def test_fused_loss_under_autocast(device, generator) -> None:
    ids, targets = (t.to(device) for t in _batch(generator))
    out = {}
    for fused in (False, True):
        torch.manual_seed(0)
        model = TransformerLM(CFG.with_(fused_loss=fused), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(ids, targets)
        loss.backward()
        out[fused] = loss.detach().float(), model.lm_head.weight.grad
    assert out[True][1].dtype == torch.float32
    torch.testing.assert_close(out[True][0], out[False][0], rtol=2e-2, atol=2e-2)
    rel = (out[True][1] - out[False][1]).norm() / out[False][1].norm()
    assert rel < 3e-2


def test_parameters_unchanged() -> None:
    model = TransformerLM(CFG.with_(fused_loss=True, checkpoint="nested"), device="meta")
    plain = TransformerLM(CFG, device="meta")
    assert isinstance(model.lm_head, LMHead) and isinstance(model.lm_head, Linear)
    assert [(n, p.shape) for n, p in model.named_parameters()] == [
        (n, p.shape) for n, p in plain.named_parameters()
    ]
    xl = get_preset("xl")
    assert count_parameters(xl.with_(fused_loss=True, checkpoint="every:2")) == count_parameters(xl)


# ---------------------------------------------------------------- D22(a) accounting


def test_accounting_hand_numbers() -> None:
    # 48 blocks (xl) in segments of 8: 6 segment inputs stay, 8 blocks live, each block recomputed once
    plan = acc.single_level(48, 8)
    assert (plan.stored_inputs, plan.live_blocks, plan.extra_block_forwards) == (6, 8, 48)
    assert plan.peak_units(1.0) == 14 and plan.compute_ratio() == pytest.approx(4 / 3)
    # nested: W(48) = 48 + 2 W(24), W(24) = 24 + 2 W(12), W(12) = 12 + 2 W(6), W(6) = 6 + 2 W(3),
    # W(3) = 3 + W(1) + W(2) = 3 + 0 + 2 = 5  ->  16, 44, 112, 272; depth ceil(log2 48) = 6 -> 7 inputs
    nested = acc.nested(48)
    assert (nested.extra_block_forwards, nested.stored_inputs, nested.live_blocks) == (272, 7, 1)
    assert acc.no_checkpointing(48).peak_units(3.0) == 144


def test_accounting_asymptotics() -> None:
    # single level at c = 1: ceil(N/k) + k is smallest at k = sqrt(N): 2 sqrt(N) for N = k^2
    for k in (4, 8, 16):
        assert acc.best_single_level(k * k, 1.0).peak_units(1.0) == 2 * k
    # c = 4 (a block's activations are 4 block inputs): ceil(48/k) + 4k: 28 at k = 3 and 4 -> 4
    assert acc.best_single_level(48, 4.0).strategy == "every:4"
    # nested: one more stored input per doubling; recompute ~ N log2 N
    peaks = [acc.nested(2**i).stored_inputs for i in range(2, 8)]
    assert [b - a for a, b in itertools.pairwise(peaks)] == [1] * 5
    assert acc.nested(64).extra_block_forwards == 64 * 6
    answer = acc.d22a(48)
    assert answer.sqrt_n.memory_order == "sqrt(N)" and answer.log_n.compute_order == "N log N"
    with pytest.raises(ValueError):
        acc.single_level(48, 0)


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flash_triton"])
def test_gpu_bf16_fused_loss_and_checkpointing(attention: str, generator) -> None:
    """On the GPU under bf16 autocast: nested checkpointing + fused loss (fp32 masters: the kernel's
    fp32-output GEMM path for dW) against neither, within bf16 tolerance."""
    ids, targets = (t.cuda() for t in _batch(generator))
    config = CFG.with_(attention=attention, num_layers=4)
    out = []
    for changes in ({}, {"checkpoint": "nested", "fused_loss": True}):
        torch.manual_seed(0)
        model = TransformerLM(config.with_(**changes), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(ids, targets)
        loss.backward()
        out.append((loss.detach().float(), {n: p.grad for n, p in model.named_parameters()}))
    torch.testing.assert_close(out[0][0], out[1][0], rtol=2e-2, atol=2e-2)
    for name, ref in out[0][1].items():
        got = out[1][1][name]
        assert got.dtype == torch.float32
        assert ((got - ref).norm() / ref.norm()).item() < 5e-2, name


# -- keep:N in bytes (D26): the 8B step, 32,768 tokens per GPU, bf16, 2 GPUs ------------------------

TOKENS_8B = 32_768
PARAMS_8B = 8_125_698_048


@pytest.mark.parametrize("compiled, measured_gib", [(True, 4.02), (False, 6.20)])
def test_block_activation_bytes_match_the_measured_cost(compiled: bool, measured_gib: float) -> None:
    # An earlier attempt measured the peak's growth per un-checkpointed block of the 8B step.
    got = acc.block_activation_bytes(get_preset("8B"), TOKENS_8B, compiled) / GIB
    assert got == pytest.approx(measured_gib, rel=0.01)


@pytest.mark.parametrize("compiled, measured_gib", [(True, 72.7), (False, 75.8)])
def test_step_memory_matches_the_measured_every1_peak(compiled: bool, measured_gib: float) -> None:
    # docs/perf-notes.md D26: ours, every:1 with attention's output kept, peak allocated per GPU.
    memory = acc.step_memory(get_preset("8B"), PARAMS_8B, TOKENS_8B, 2, compiled)
    assert memory.peak(0) / GIB == pytest.approx(measured_gib, rel=0.03)


def test_blocks_to_keep_is_the_most_that_fit() -> None:
    memory = acc.step_memory(get_preset("8B"), PARAMS_8B, TOKENS_8B, 2, compiled=True)
    n = acc.blocks_to_keep(memory, 124 * GIB)
    assert memory.peak(n) <= 124 * GIB < memory.peak(n + 1)
    assert n == 14  # (124 - 72.2) / (4.02 - 0.5) GiB per kept block
    assert acc.blocks_to_keep(memory, memory.peak(0) - 1) == 0  # nothing fits: every:1
    assert acc.blocks_to_keep(memory, 1e15) == 34  # everything fits: none
    eager = acc.step_memory(get_preset("8B"), PARAMS_8B, TOKENS_8B, 2, compiled=False)
    assert acc.blocks_to_keep(eager, 124 * GIB) < n  # an eager block saves more
