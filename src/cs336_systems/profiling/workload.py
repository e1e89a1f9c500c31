"""One end-to-end benchmark case: model + random batch + the step of a mode (timed by
``harness.model_case.benchmark_model_case``).

Shared by the CLI (``python -m cs336_systems.cli.benchmark``) and the bench cases (``bench/bench_model.py``,
``bench/bench_profile.py``), so both time exactly the same code.

Modes (handout 1.1.3):
- ``fwd``: inference forward pass under ``torch.no_grad`` (no activations kept for backward).
- ``fwd_bwd``: forward, cross-entropy loss, backward (gradients set to None first, no accumulate).
- ``train``: ``fwd_bwd`` then an AdamW step (the suite's own AdamW).
Precision: ``fp32``, or ``bf16`` = bf16 autocast around forward and loss (parameters, gradients and
optimizer state stay fp32; backward runs outside autocast, as torch recommends).
Every step stage runs inside an NVTX/profiler range ("forward", "loss", "backward", "optimizer step"),
and each block's attention and feed-forward too, so ``nsys`` and ``torch.profiler`` see the same ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from cs336_systems.attention import attention_names
from cs336_systems.model import (
    BATCH_SIZE,
    AdamW,
    ModelConfig,
    TransformerLM,
    annotated_forward,
    cross_entropy,
    get_preset,
)
from cs336_systems.nvtx import annotate
from cs336_systems.profiling.flops import MODES, measure_matmul_tflops, step_flops
from cs336_systems.profiling.memory import free_device_memory

DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODE_ALIASES = {
    "forward": "fwd",
    "forward+backward": "fwd_bwd",
    "forward_backward": "fwd_bwd",
    "fwd+bwd": "fwd_bwd",
    "step": "train",
}


def normalize_mode(mode: str) -> str:
    mode = MODE_ALIASES.get(mode, mode)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES} (or {sorted(MODE_ALIASES)})")
    return mode


@dataclass(frozen=True)
class Case:
    """What one benchmark case runs; ``id`` is its readable name, e.g. ``xl-ctx512-bf16-train-compiled``."""

    size: str
    ctx: int
    mode: str = "fwd_bwd"
    dtype: str = "fp32"
    compile: bool = False
    attention: str = "pytorch"
    batch: int = BATCH_SIZE
    overrides: tuple[tuple[str, int], ...] = field(default=())  # e.g. (("num_layers", 2),)
    checkpoint: str = "none"  # activation checkpointing policy (ModelConfig.checkpoint)
    fused_loss: bool = False  # loss through the fused LM-head + cross-entropy kernel
    # compiled with mode="reduce-overhead": inductor's code replayed from CUDA graphs, so a step costs
    # the host a few graph launches instead of one launch per kernel (needs ``compile``)
    cudagraphs: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mode", normalize_mode(self.mode))
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown precision {self.dtype!r}; choose one of {sorted(DTYPES)}")
        if self.ctx < 1 or self.batch < 1:
            raise ValueError(
                f"context length and batch must be positive, got ctx={self.ctx} batch={self.batch}"
            )
        if self.cudagraphs and not self.compile:
            raise ValueError(
                "CUDA graphs (cudagraphs=True, --cudagraphs) need the compiled model (--compile)"
            )
        if self.attention not in attention_names():
            raise ValueError(f"unknown attention {self.attention!r}; choose one of {attention_names()}")
        _ = self.config  # validates the preset name and the overrides now, not at build time

    @property
    def config(self) -> ModelConfig:
        preset = get_preset(self.size)
        # RoPE tables must cover the context; their length costs no compute.
        return preset.with_(
            attention=self.attention,
            context_length=max(self.ctx, preset.context_length),
            checkpoint=self.checkpoint,
            fused_loss=self.fused_loss,
            **dict(self.overrides),
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def id(self) -> str:
        parts = [self.size, f"ctx{self.ctx}", self.dtype, self.mode, self.compile_name]
        if self.attention != "pytorch":
            parts.append(self.attention)
        if self.batch != BATCH_SIZE:
            parts.append(f"b{self.batch}")
        parts += [f"{k}{v}" for k, v in self.overrides]
        if self.checkpoint != "none":
            parts.append("ckpt" + self.checkpoint.replace(":", ""))
        if self.fused_loss:
            parts.append("fusedloss")
        return "-".join(parts)

    @property
    def compile_name(self) -> str:
        """eager, compiled, or cudagraphs (compiled with mode="reduce-overhead")."""
        return "cudagraphs" if self.cudagraphs else "compiled" if self.compile else "eager"

    @property
    def flops(self) -> int:
        return step_flops(self.config, self.batch, self.ctx, self.mode)

    def info(self) -> dict[str, Any]:
        """The case's description as extra_info fields (the report's table columns)."""
        return {
            "size": self.size,
            "ctx": self.ctx,
            "dtype": self.dtype,
            "mode": self.mode,
            "compile": self.compile_name,
            "compiled": self.compile,
            "attention": self.attention,
            "batch": self.batch,
            "checkpoint": self.checkpoint,
            "fused_loss": self.fused_loss,
            "model_flops": self.flops,
        }


class Workload:
    """Model, optimizer, batch and step of one case on one device. Use as a context manager (or call
    ``close``) so the model, optimizer state and compiled graphs are freed before the next case."""

    def __init__(
        self, case: Case, device: torch.device | str, *, seed: int = 0, compile_backend: str = "inductor"
    ):
        self.case = case
        self.device = torch.device(device)
        if case.dtype == "bf16" and self.device.type == "cuda" and not torch.cuda.is_bf16_supported():
            raise ValueError(f"{self.device} does not support bf16")
        torch.manual_seed(seed)
        self.model = TransformerLM(case.config, device=self.device)  # parameters stay fp32
        self.model.train()
        # For clear_grads: zero_grad walks the module tree on every call (small: 140 us of host time against
        # 6 us for this list, on a CPU host), which a host-bound CUDA-graphed step pays in full.
        self.parameters = list(self.model.parameters())
        annotated_forward(self.model)
        if case.compile:
            torch._dynamo.reset()  # fresh guards/caches: a sweep must not hit the recompile limit
            mode = "reduce-overhead" if case.cudagraphs else None
            self.forward_fn: Callable[[torch.Tensor], torch.Tensor] = torch.compile(
                self.model, backend=compile_backend, mode=mode
            )
        else:
            self.forward_fn = self.model
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, case.config.vocab_size, (case.batch, case.ctx + 1), generator=gen)
        self.inputs = tokens[:, :-1].contiguous().to(self.device)
        self.targets = tokens[:, 1:].contiguous().to(self.device)
        self.optimizer = AdamW(self.model.parameters(), lr=1e-4) if case.mode == "train" else None

    def _precision(self) -> contextlib.AbstractContextManager:
        if self.case.dtype == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.case.torch_dtype)

    def forward(self) -> torch.Tensor:
        with annotate("forward"), self._precision():
            return self.forward_fn(self.inputs)

    def loss(self) -> torch.Tensor:
        if self.case.fused_loss:  # the model returns the loss itself: logits are never materialized
            with annotate("forward"), self._precision():
                return self.forward_fn(self.inputs, self.targets)
        logits = self.forward()
        with annotate("loss"), self._precision():
            return cross_entropy(logits, self.targets)

    def step(self) -> None:
        """One step of the case's mode (what every timed round runs)."""
        if self.case.cudagraphs:  # a new iteration: outputs of the previous replays may be overwritten
            torch.compiler.cudagraph_mark_step_begin()
        if self.case.mode == "fwd":
            with torch.no_grad():
                self.forward()
            return
        self.clear_grads()
        loss = self.loss()
        with annotate("backward"):
            loss.backward()
        if self.optimizer is not None:
            with annotate("optimizer step"):
                self.optimizer.step()

    def clear_grads(self) -> None:
        """``zero_grad(set_to_none=True)``: no kernel, backward writes fresh gradients."""
        for p in self.parameters:
            p.grad = None

    def close(self) -> None:
        compiled = self.case.compile
        for name in ("forward_fn", "model", "parameters", "optimizer", "inputs", "targets"):
            self.__dict__.pop(name, None)
        if compiled:
            torch._dynamo.reset()
        free_device_memory()

    def __enter__(self) -> Workload:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def peak_rate(device: torch.device, dtype: str, cache: dict[str, float] | None = None) -> float:
    """Measured matmul TFLOP/s for a case precision (bf16 autocast -> bf16 matmul rate)."""
    if cache is not None and dtype in cache:
        return cache[dtype]
    rate = measure_matmul_tflops(device, DTYPES[dtype])
    if cache is not None:
        cache[dtype] = rate
    return rate
