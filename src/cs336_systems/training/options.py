"""The 8B step's configuration: :class:`StepOptions` (every piece a field), the two recipes and
the ablations, the checkpoint policy (``keep:auto`` resolved from the accounting's predicted peak)
and the SPEC's model FLOPs of one step."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

import torch

from cs336_systems.accounting import checkpointing as ckpt_accounting
from cs336_systems.distributed.comm import world
from cs336_systems.model import ModelConfig, count_parameters, get_preset
from cs336_systems.model.checkpointing import parse_checkpoint
from cs336_systems.training.course_timing import COLD_START_LIMIT_S, COURSE_REP_MS, COURSE_WARMUP_MS
from cs336_systems.units import GIB

FSDP_CHOICES = ("ours", "torch", "none")
LOSS_CHOICES = ("fused", "chunked", "full")
OPTIMIZER_CHOICES = ("fused_ours", "torch_fused")
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


@dataclass(frozen=True)
class StepOptions:
    preset: str = "8B"
    model_changes: dict[str, Any] = field(default_factory=dict)  # e.g. a scaled-down config for tests
    batch_per_rank: int = 1
    seq_len: int | None = None  # default: the preset's context length
    fsdp: str = "ours"
    attention: str = "flash_triton"
    loss: str = "fused"
    loss_chunk_tokens: int = 4096
    optimizer: str = "fused_ours"
    checkpoint: str = "every:1"  # "none", "every:1", "keep:N" or "keep:auto" (step_checkpoint_policy)
    keep_budget_gib: float | None = None  # keep:auto's peak budget; None: KEEP_BUDGET_SHARE of the GPU
    save_attention: bool = True  # selective: checkpointed blocks keep attention's output (no re-run)
    # selective, further: checkpointed blocks also keep every matmul's output, so their re-run in the
    # backward recomputes only the elementwise work (norms, RoPE, SwiGLU's product). Off until a GPU
    # measurement shows it pays for its memory (5·u + 2·f per block, 2.6 GiB at 8B / 32k tokens).
    save_matmuls: bool = False
    # Each FSDP unit's AdamW steps inside the backward, as soon as its gradient shard is reduced, and
    # the shard is freed (distributed.optim_in_backward); ours FSDP only, and not with grad_clip (the
    # global norm needs every gradient first): then the plain step runs (optimizer_in_backward_plan).
    optimizer_in_backward: bool = False
    grad_clip: float | None = None  # max global gradient norm; None: no clipping (the leaderboard)
    compile: bool = False
    compute_dtype: str = "bf16"  # what the gathered weights (and so activations) are cast to
    reduce_dtype: str = "fp32"  # gradients are reduced and kept in this dtype
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    warmup: int = 1  # untimed steps after the first one
    steps: int = 3  # timed steps
    profile: bool = False  # one extra profiled step: the top CUDA kernels by time
    # After the timed steps, the course's protocol too: do_bench(rep, warmup) (training.course_timing)
    course_timing: bool = False
    course_rep_ms: int = COURSE_REP_MS
    course_warmup_ms: int = COURSE_WARMUP_MS
    cold_start_limit_s: float = COLD_START_LIMIT_S  # a run from empty caches must end within this
    cache_dir: str | None = None  # compile/autotune caches go here (an empty one: the cold-cache figure)
    return_params: bool = False  # return the full trained parameters (tests; small models only)
    progress: bool = False  # rank 0 prints a line to stderr per step (the CLI's default)

    def __post_init__(self) -> None:
        for name, value, choices in (
            ("fsdp", self.fsdp, FSDP_CHOICES),
            ("loss", self.loss, LOSS_CHOICES),
            ("optimizer", self.optimizer, OPTIMIZER_CHOICES),
            ("compute_dtype", self.compute_dtype, tuple(DTYPES)),
            ("reduce_dtype", self.reduce_dtype, tuple(DTYPES)),
        ):
            if value not in choices:
                raise ValueError(f"unknown {name} {value!r}; choose one of {choices}")
        validate_step_checkpoint(self.checkpoint)
        if self.keep_budget_gib is not None and self.keep_budget_gib <= 0:
            raise ValueError(f"keep_budget_gib must be positive, got {self.keep_budget_gib}")
        if self.course_rep_ms <= 0 or self.course_warmup_ms <= 0:
            raise ValueError(f"course_rep_ms and course_warmup_ms must be positive, got {self}")
        if self.grad_clip is not None and self.grad_clip <= 0:
            raise ValueError(f"grad_clip must be positive, got {self.grad_clip}")
        if self.batch_per_rank < 1 or self.steps < 0 or self.warmup < 0:
            raise ValueError(f"need batch_per_rank >= 1 and non-negative steps, got {self}")

    def model_config(self) -> ModelConfig:
        config = get_preset(self.preset, **self.model_changes)
        return config.with_(attention=self.attention)

    @property
    def sequence_length(self) -> int:
        return self.seq_len or self.model_config().context_length

    @property
    def label(self) -> str:
        parts = [f"fsdp={self.fsdp}", f"attn={self.attention}", f"loss={self.loss}", f"opt={self.optimizer}"]
        kept = ("+attn" if self.save_attention else "") + ("+mm" if self.save_matmuls else "")
        parts += [f"ckpt={self.checkpoint}{kept}"]
        parts += ["opt-in-bwd"] if self.optimizer_in_backward else []
        parts += [f"clip={self.grad_clip:g}"] if self.grad_clip is not None else []
        parts += ["compiled" if self.compile else "eager"]
        return " ".join(parts)


# The two full configurations: the suite's pieces (StepOptions' defaults) and torch's built-ins as in
# the SPEC's anchor (FSDP2 bf16/fp32, per-block checkpointing, SDPA, fused AdamW, 4096-token chunks).
RECIPES: dict[str, dict[str, Any]] = {
    "ours": dict(
        fsdp="ours",
        attention="flash_triton",
        loss="fused",
        optimizer="fused_ours",
        save_attention=True,
        # Off until the ablation row shows it pays: at 8B / 32k tokens the peak is at the start of the
        # backward, before any gradient exists (accounting.checkpointing.StepMemory), so it frees
        # memory only later in the backward, where the peak is not.
        optimizer_in_backward=False,
    ),
    "torch": dict(
        fsdp="torch", attention="sdpa", loss="chunked", optimizer="torch_fused", save_attention=False
    ),
}


def optimizer_in_backward_plan(options: StepOptions) -> tuple[bool, str]:
    """(whether the step runs the optimizer inside the backward, why), from what was asked: the
    in-backward step needs the suite's FSDP (its per-unit gradient callback) and no clipping."""
    if not options.optimizer_in_backward:
        return False, "off: the optimizer steps after the backward"
    if options.fsdp != "ours":
        return False, f"asked, but fsdp={options.fsdp!r}: the plain step (needs fsdp='ours')"
    if options.grad_clip is not None:
        return False, (
            f"asked, but grad_clip={options.grad_clip:g}: the plain step (clipping needs the global "
            "gradient norm before any unit may step)"
        )
    return True, "on: each unit's AdamW steps as its gradient shard is reduced, then frees it"


# One piece of "ours" swapped for torch's (or switched off): what that piece buys.
ABLATIONS: dict[str, dict[str, Any]] = {
    "optimizer_in_backward": dict(optimizer_in_backward=True),  # not a swap: the lever switched on
    "sdpa": dict(attention="sdpa"),
    "fsdp2": dict(fsdp="torch"),
    "full_recompute": dict(save_attention=False),
    "torch_adamw": dict(optimizer="torch_fused"),
    "full_logits": dict(loss="full"),
}


# The pieces of ours that run Triton kernels (CUDA, or the CPU under TRITON_INTERPRET=1 only, slowly),
# with torch's piece for each: what a step runs on a CPU unless asked otherwise.
TRITON_PIECES: dict[str, tuple[str, str]] = {
    "attention": ("flash_triton", "sdpa"),
    "loss": ("fused", "chunked"),
    "optimizer": ("fused_ours", "torch_fused"),
}


def triton_pieces(options: StepOptions) -> dict[str, str]:
    """The fields of ``options`` set to a piece that runs Triton kernels, with their values."""
    return {f: getattr(options, f) for f, (ours, _) in TRITON_PIECES.items() if getattr(options, f) == ours}


def without_triton(options: StepOptions) -> tuple[StepOptions, dict[str, str]]:
    """``options`` with each Triton piece swapped for torch's; also returns the swaps (field -> new)."""
    swaps = {f: TRITON_PIECES[f][1] for f in triton_pieces(options)}
    return replace(options, **swaps), swaps


def recipe(name: str, **changes: Any) -> StepOptions:
    """``StepOptions`` of a named recipe ("ours" or "torch"), with ``changes`` on top."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return StepOptions(**(RECIPES[name] | changes))


STEP_CHECKPOINT_GRAMMAR = "'none', 'every:1', 'keep:N' (N >= 0 last blocks not checkpointed) or 'keep:auto'"
# keep:auto's default budget: this share of the GPU's memory (112 GiB of an H200's 140, keep:11 for the
# 8B step compiled). A higher share (0.885) ran out of memory: the closed form runs low by a few GiB at
# high N and fixed-size segments fragment, so the share is lower and the step uses expandable segments
# (see ``_use_expandable_segments``). Measured: docs/perf-notes.md, D26, the keep:auto OOM.
KEEP_BUDGET_SHARE = 0.80
KEEP_BUDGET_CPU_GIB = 112.0  # without a GPU (tests, planning): an H200's budget


def validate_step_checkpoint(policy: str) -> None:
    """The driver checkpoints per block (its FSDP units are blocks, each wrapped on its own), so it
    takes the per-block policies only; every:K with K > 1 would need a segment of units."""
    if policy == "keep:auto":
        return
    try:
        kind, k = parse_checkpoint(policy)
    except ValueError:
        raise ValueError(
            f"invalid checkpoint policy {policy!r} for the 8B step; expected {STEP_CHECKPOINT_GRAMMAR}"
        ) from None
    if kind == "nested" or (kind == "every" and k > 1):
        raise ValueError(
            f"checkpoint policy {policy!r} is not supported by the 8B step: it checkpoints each block on "
            f"its own (FSDP units are blocks); expected {STEP_CHECKPOINT_GRAMMAR}"
        )


def keep_budget_bytes(options: StepOptions) -> float:
    """keep:auto's budget: ``keep_budget_gib`` if set, else KEEP_BUDGET_SHARE of this GPU's memory."""
    if options.keep_budget_gib is not None:
        return options.keep_budget_gib * GIB
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        return KEEP_BUDGET_SHARE * total
    return KEEP_BUDGET_CPU_GIB * GIB


def matmul_output_bytes(config: ModelConfig, tokens: int, compute_bytes: int = 2) -> int:
    """What ``save_matmuls`` adds to a checkpointed block: the outputs of its five matmuls, QKV (3u),
    the output projection (u), w1 and w3 (2f) and w2 (u), u = tokens · d_model, f = tokens · d_ff."""
    return (5 * tokens * config.d_model + 2 * tokens * config.d_ff) * compute_bytes


def predicted_step_memory(options: StepOptions, world_size: int) -> ckpt_accounting.StepMemory:
    config = options.model_config()
    tokens = options.batch_per_rank * options.sequence_length
    memory = ckpt_accounting.step_memory(
        config,
        n_params=count_parameters(config),
        tokens=tokens,
        world_size=world_size,
        compiled=options.compile,
        save_attention=options.save_attention,
        optimizer_in_backward=optimizer_in_backward_plan(options)[0],
    )
    if options.save_matmuls:
        memory = replace(memory, checkpointed=memory.checkpointed + matmul_output_bytes(config, tokens))
    return memory


def step_checkpoint_policy(options: StepOptions, world_size: int | None = None) -> str:
    """The concrete policy the step runs: ``keep:auto`` becomes ``keep:N``, N the most last blocks
    whose predicted peak (``accounting.checkpointing.step_memory``) fits :func:`keep_budget_bytes`.
    Every rank computes the same N (same model, same GPU kind), so the ranks' models agree."""
    if options.checkpoint != "keep:auto":
        return options.checkpoint
    world_size = world()[1] if world_size is None else world_size
    memory = predicted_step_memory(options, world_size)
    return f"keep:{ckpt_accounting.blocks_to_keep(memory, keep_budget_bytes(options))}"


def proxy_checkpoint_policy(options: StepOptions, full_world_size: int = 2) -> str:
    """``keep:N`` for a proxy of the step (fewer blocks, one GPU, unsharded) whose checkpointing the
    full step's ``keep:auto`` decides: the full preset's step on ``full_world_size`` GPUs, under the
    same per-GPU budget (:func:`keep_budget_bytes`), keeps its last K of B blocks; the proxy keeps the
    same share of its own blocks (round(L * K / B)), so recompute is the same share of its compute and
    a gain measured on the proxy carries over; fewer if the proxy's own predicted peak is over budget."""
    layers = options.model_config().num_layers
    full_changes = {k: v for k, v in options.model_changes.items() if k != "num_layers"}
    full = replace(options, model_changes=full_changes, fsdp="ours", checkpoint="keep:auto")
    full_policy = step_checkpoint_policy(full, full_world_size)
    full_blocks = full.model_config().num_layers
    share = round(layers * int(full_policy.split(":")[1]) / full_blocks)
    own = ckpt_accounting.blocks_to_keep(predicted_step_memory(options, 1), keep_budget_bytes(options))
    return f"keep:{min(share, own)}"


# -- FLOPs: the SPEC's convention for D26 ------------------------------------------------------------


def model_flops_per_step(config: ModelConfig, batch: int, seq: int) -> float:
    """6 x matmul parameters x tokens + causal attention 6·L·S²·D per sequence (half the S² work; the
    SPEC's count, 4.74e15 for the 8B step). Embedding lookups are not matmuls and are left out."""
    d, layers = config.d_model, config.num_layers
    matmul_params = layers * (4 * d * d + 3 * d * config.d_ff) + d * config.vocab_size
    return 6.0 * matmul_params * batch * seq + 6.0 * layers * seq * seq * d * batch


# MFU's two denominators (the bf16 matmul rate measured in the process, the GPU's dense bf16 peak)
# come from profiling.flops, one table for the suite.
FLOP_FORMULA = "6N + causal attention (6·L·S²·D per sequence); recomputation not counted"


def dense_bf16_peak_tflops(device_name: str | None) -> float | None:
    """The data-sheet dense bf16 peak of the GPU named ``device_name`` (None: not in the table)."""
    from cs336_systems.profiling.flops import dense_bf16_peak_tflops as peak

    return peak(device_name or "")
