"""Memory for long contexts (issue 16): activation checkpointing (D22), the fused LM-head + cross-entropy
and the fused AdamW step, each beside the torch version it replaces.

Groups:
- ``D22 activation checkpointing``: xl, batch 4, bf16 autocast training step (the suite's AdamW), eager,
  ctx 2048 on a card of more than 100 GiB (H200), else 1024 (H100): peak memory and step time per
  policy (none, every:1/2/3/4/6/8, nested). OOM is a row.
- ``D26 fused LM-head cross-entropy``: forward + backward of the loss of ``h @ W.T`` (bf16) at
  (tokens, d, vocab) = (8192, 2048, 10000) and (32768, 4096, 151936): ``full`` = F.cross_entropy over
  the full logits, ``chunked`` = torch over checkpointed chunks of 4096 tokens (logits recomputed in
  backward), ``fused`` = kernels/fused_cross_entropy.py. extra_info ``extra_mib`` = peak minus the
  inputs (the gradients of h and W included, as every version must produce them); the fused row also
  carries its ratios to ``full`` measured in the same run.
- ``D26 fused AdamW``: one optimizer step over random fp32 parameters and gradients of the xl and 2.7B
  shapes: torch.optim.AdamW(fused=True), AdamW(foreach=True) and kernels/fused_adamw.FusedAdamW (ratio
  to fused=True on its row).

On the CPU each group runs tiny cases (a 2-layer model, 64 tokens, the tiny preset's shapes) so the
bench run stays a smoke test; the Triton kernels then run under the interpreter.

    pytest bench/bench_memory.py --benchmark-json=OUT.json
    python -m cs336_systems.report OUT.json ...      # tables
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cs336_systems.harness.environment import environment_info
from cs336_systems.harness.model_case import benchmark_model_case
from cs336_systems.harness.record import record_oom, run_benchmark
from cs336_systems.kernels.fused_adamw import FusedAdamW
from cs336_systems.kernels.fused_cross_entropy import fused_linear_cross_entropy
from cs336_systems.model import TransformerLM, get_preset
from cs336_systems.profiling.memory import free_device_memory
from cs336_systems.profiling.timing import is_oom
from cs336_systems.profiling.workload import Case
from cs336_systems.rows.schema import tag

ON_GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if ON_GPU else "cpu")
POLICIES = ("none", "every:1", "every:2", "every:3", "every:4", "every:6", "every:8", "nested")
LOSS_SHAPES = ((8192, 2048, 10_000), (32768, 4096, 151_936)) if ON_GPU else ((16, 16, 100),)
LOSS_IMPLS = ("full", "chunked", "fused")
OPT_SIZES = ("xl", "2.7B") if ON_GPU else ("tiny",)
OPT_IMPLS = ("torch_fused", "torch_foreach", "triton_fused")
TORCH_CHUNK = 4096  # the chunked torch loss: SPEC's D26 anchor uses checkpointed chunks of 4096 tokens

# Rows measured earlier in this run, for the ratios on the fused rows: {(group, case): (ms, extra MiB)}.
_MEASURED: dict[tuple[str, object], tuple[float, float | None]] = {}


def _d22_ctx() -> int:
    if not ON_GPU:
        return 32
    return 2048 if torch.cuda.get_device_properties(DEVICE).total_memory > 100 * 2**30 else 1024


# ---------------------------------------------------------------- D22 checkpointing


@pytest.mark.parametrize("policy", POLICIES)
def test_checkpointing(benchmark, policy: str) -> None:
    tag(benchmark, "checkpointing", "xl" if ON_GPU else "tiny")
    if ON_GPU:
        case = Case("xl", _d22_ctx(), "train", "bf16", checkpoint=policy)
        warmup, rounds = 1, 3
    else:
        case = Case("tiny", _d22_ctx(), "train", "fp32", checkpoint=policy, overrides=(("num_layers", 4),))
        warmup, rounds = 1, 2
    info = benchmark_model_case(benchmark, case, DEVICE, warmup=warmup, rounds=rounds)
    if not info.get("oom"):
        benchmark.extra_info["peak_gib"] = (info.get("peak_memory_mib") or 0) / 1024


# ---------------------------------------------------------------- fused loss


def _full_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(h @ w.T, t)


def _chunk_loss_sum(h_c: torch.Tensor, w: torch.Tensor, t_c: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(h_c @ w.T, t_c, reduction="sum")


def _chunked_loss(h: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    total = sum(
        checkpoint(_chunk_loss_sum, h[s : s + TORCH_CHUNK], w, t[s : s + TORCH_CHUNK], use_reentrant=False)
        for s in range(0, h.shape[0], TORCH_CHUNK)
    )
    return total / t.numel()  # no ignored targets here


LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "full": _full_loss,
    "chunked": _chunked_loss,
    "fused": fused_linear_cross_entropy,
}


@pytest.mark.parametrize(
    "shape, impl",
    [pytest.param(s, i, id=f"{s[0]}x{s[1]}x{s[2]}-{i}") for s in LOSS_SHAPES for i in LOSS_IMPLS],
)
def test_fused_loss(benchmark, shape: tuple[int, int, int], impl: str) -> None:
    tokens, d, vocab = shape
    tag(benchmark, "fused_loss", f"{tokens}x{d}x{vocab}")
    dtype = torch.bfloat16 if ON_GPU else torch.float32
    info = {"tokens": tokens, "d_model": d, "vocab": vocab, "impl": impl, "dtype": str(dtype)}
    info.update(environment_info(DEVICE))
    free_device_memory()
    try:
        gen = torch.Generator(DEVICE).manual_seed(0)
        h = torch.randn(tokens, d, device=DEVICE, dtype=dtype, generator=gen).requires_grad_()
        w = (torch.randn(vocab, d, device=DEVICE, dtype=dtype, generator=gen) * d**-0.5).requires_grad_()
        t = torch.randint(0, vocab, (tokens,), device=DEVICE, generator=gen)
    except Exception as exc:
        if not is_oom(exc):
            raise
        record_oom(benchmark, **info)
        return
    base_mib = torch.cuda.memory_allocated(DEVICE) / 2**20 if ON_GPU else None
    loss_fn = LOSSES[impl]

    def clear() -> None:
        h.grad = w.grad = None

    def step() -> None:
        loss_fn(h, w, t).backward()

    times = run_benchmark(
        benchmark, step, DEVICE, warmup=2 if ON_GPU else 1, rounds=5 if ON_GPU else 2, setup=clear, **info
    )
    if times is not None:
        extra = benchmark.extra_info["peak_memory_mib"] - base_mib if ON_GPU else None
        grads_mib = (h.numel() * h.element_size() + w.numel() * w.element_size()) / 2**20
        benchmark.extra_info.update(
            extra_mib=extra, grads_mib=grads_mib, full_logits_mib=tokens * vocab * h.element_size() / 2**20
        )
        _ratios(benchmark, "fused_loss", shape, impl, "full", benchmark.extra_info["median_ms"], extra)


def _ratios(benchmark, group: str, case, impl: str, reference: str, ms: float, mib: float | None) -> None:
    _MEASURED[(group, case, impl)] = (ms, mib)
    ref = _MEASURED.get((group, case, reference))
    if ref is None or impl == reference:
        return
    benchmark.extra_info[f"time_vs_{reference}"] = ms / ref[0]
    if mib is not None and ref[1]:
        benchmark.extra_info[f"extra_mib_vs_{reference}"] = mib / ref[1]


# ---------------------------------------------------------------- fused AdamW


def _param_shapes(size: str) -> list[torch.Size]:
    config = get_preset(size) if size != "tiny" else get_preset("tiny", vocab_size=256)
    return [p.shape for p in TransformerLM(config, device="meta").parameters()]


def _optimizer(impl: str, params: list[torch.Tensor]) -> torch.optim.Optimizer:
    kw = dict(lr=1e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    if impl == "triton_fused":
        return FusedAdamW(params, **kw)
    return torch.optim.AdamW(params, **kw, **{impl.removeprefix("torch_"): True})


@pytest.mark.parametrize("size", OPT_SIZES)
@pytest.mark.parametrize("impl", OPT_IMPLS)
def test_fused_adamw(benchmark, size: str, impl: str) -> None:
    tag(benchmark, "fused_adamw", size)
    shapes = _param_shapes(size)
    n = sum(s.numel() for s in shapes)
    info = {"size": size, "impl": impl, "params": n, "tensors": len(shapes), **environment_info(DEVICE)}
    # the floor: read param, grad and both moments, write param and both moments, in fp32
    info["min_bytes"] = 28 * n
    free_device_memory()
    try:
        gen = torch.Generator(DEVICE).manual_seed(0)
        params = [torch.nn.Parameter(torch.randn(s, device=DEVICE, generator=gen)) for s in shapes]
        for p in params:
            p.grad = torch.randn(p.shape, device=DEVICE, generator=gen) * 1e-3
        opt = _optimizer(impl, params)
    except Exception as exc:
        if not is_oom(exc):
            raise
        record_oom(benchmark, **info)
        return
    warmup, rounds = (3, 10) if ON_GPU else (1, 2)
    times = run_benchmark(benchmark, opt.step, DEVICE, warmup=warmup, rounds=rounds, **info)
    if times is not None:
        ms = benchmark.extra_info["median_ms"]
        benchmark.extra_info["gb_per_s"] = 28 * n / (ms / 1e3) / 1e9
        _ratios(benchmark, "fused_adamw", size, impl, "torch_fused", ms, None)
    del params, opt
    free_device_memory()
