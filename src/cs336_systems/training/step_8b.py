"""D26: one full training step of the 8B model on 2 GPUs, from the suite's pieces or torch's.

A step is: token embedding -> blocks (each checkpointed, optionally compiled) -> final RMSNorm -> the
LM head, which computes the loss in its own forward -> backward -> gradient reduce-scatter -> AdamW on
the local shards. Every piece is a field of :class:`StepOptions` and a flag of
``python -m cs336_systems.cli.train_8b``, so each can be swapped for torch's to see what it buys:

==============  ==========================================  ===========================================
field           the suite's (default)                       torch's
==============  ==========================================  ===========================================
``fsdp``        ``ours``: :mod:`cs336_systems.distributed.   ``torch``: FSDP2 ``fully_shard`` on the same
                fsdp`, bf16 compute, fp32 reduce             units, MixedPrecisionPolicy(bf16, fp32)
``attention``   ``flash_triton`` (FlashAttention-2, Triton)  ``sdpa``
``loss``        ``fused`` (linear + cross-entropy kernel,    ``chunked`` (checkpointed chunks of 4096
                no logits in memory)                         tokens), ``full`` (whole logits, fp32 CE)
``optimizer``   ``fused_ours`` (FusedAdamW on the shards)    ``torch_fused`` (``AdamW(fused=True)``)
``checkpoint``  ``every:1`` (each block recomputed);        the same
                ``keep:N`` / ``keep:auto``: the last N
                blocks not checkpointed (the bench's
                compiled ``ours`` row uses ``keep:auto``)
``compile``     False / True: each block's forward compiled  the same
==============  ==========================================  ===========================================

FSDP units are the same for both: each block one unit, the embedding and the LM head units of their
own, the final norm with the root. ``fsdp="none"`` runs the unsharded model in one process (the CPU
test's reference).

Initialization: the model is built on the meta device; then unit by unit each module is materialized
on the rank's device, initialized from a seed of its own (its index in ``model.modules()``) and the unit
is sharded before the next one is materialized. A rank so holds at most one unit's full fp32 weights
(2.5 GB for the 8B embedding), never the model's 32.5 GB, and the initial weights are the same on any
number of ranks, which lets a test compare N ranks with one process.

Timing (:func:`run_step`): a synchronized loop; each rank times each step on its host clock after a
device synchronize, and :func:`cs336_systems.distributed.train_step.combine_ranks` takes the max over
ranks per step (a step ends when its slowest rank does). ``first_step_s`` is the time from the start
of :func:`run_step` (process group up, torch imported) to the end of the first finished step: model
build, sharding, materialization, compilation and autotuning included; run it with an empty
``cache_dir`` for the course's cold-cache figure.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils.checkpoint import checkpoint

from cs336_systems.accounting import checkpointing as ckpt_accounting
from cs336_systems.distributed.comm import barrier, rank_device, shard_batch, share_cpu_threads, world
from cs336_systems.distributed.fsdp import FSDP, is_sharded_layer
from cs336_systems.model import ModelConfig, TransformerLM, count_parameters, get_preset
from cs336_systems.model.checkpointing import checkpointed_blocks, parse_checkpoint
from cs336_systems.model.transformer import Embedding, Linear, RMSNorm, RotaryEmbedding
from cs336_systems.profiling.flops import measure_matmul_tflops
from cs336_systems.profiling.timing import synchronize
from cs336_systems.units import GIB, MIB

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
    compile: bool = False
    compute_dtype: str = "bf16"  # what the gathered weights (and so activations) are cast to
    reduce_dtype: str = "fp32"  # gradients are reduced and kept in this dtype
    lr: float = 3e-4
    weight_decay: float = 0.1
    seed: int = 0
    warmup: int = 1  # untimed steps after the first one
    steps: int = 3  # timed steps
    profile: bool = False  # one extra profiled step: the top CUDA kernels by time
    cache_dir: str | None = None  # compile/autotune caches go here (an empty one: the cold-cache figure)
    return_params: bool = False  # return the full trained parameters (tests; small models only)

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
        parts += [f"ckpt={self.checkpoint}{'+attn' if self.save_attention else ''}"]
        parts += ["compiled" if self.compile else "eager"]
        return " ".join(parts)


# The two full configurations: the suite's pieces (StepOptions' defaults) and torch's built-ins as in
# the SPEC's anchor (FSDP2 bf16/fp32, per-block checkpointing, SDPA, fused AdamW, 4096-token chunks).
RECIPES: dict[str, dict[str, Any]] = {
    "ours": dict(
        fsdp="ours", attention="flash_triton", loss="fused", optimizer="fused_ours", save_attention=True
    ),
    "torch": dict(
        fsdp="torch", attention="sdpa", loss="chunked", optimizer="torch_fused", save_attention=False
    ),
}
# One piece of "ours" swapped for torch's (or switched off): what that piece buys.
ABLATIONS: dict[str, dict[str, Any]] = {
    "sdpa": dict(attention="sdpa"),
    "fsdp2": dict(fsdp="torch"),
    "full_recompute": dict(save_attention=False),
    "torch_adamw": dict(optimizer="torch_fused"),
    "full_logits": dict(loss="full"),
}


def recipe(name: str, **changes: Any) -> StepOptions:
    """``StepOptions`` of a named recipe ("ours" or "torch"), with ``changes`` on top."""
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {sorted(RECIPES)}")
    return StepOptions(**(RECIPES[name] | changes))


STEP_CHECKPOINT_GRAMMAR = "'none', 'every:1', 'keep:N' (N >= 0 last blocks not checkpointed) or 'keep:auto'"
# keep:auto's default budget: this share of the GPU's memory (112 GiB of an H200's 140, keep:11 for the
# 8B step compiled). Measured on 2 x H200 at 0.885 (keep:14, predicted 121.4 GiB): OOM with 123.6 GiB
# allocated and 13.6 GiB reserved but free (fragmentation) when it failed. So the closed form runs low
# by a few GiB at high N, and the step now uses expandable segments (see ``_use_expandable_segments``).
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


def predicted_step_memory(options: StepOptions, world_size: int) -> ckpt_accounting.StepMemory:
    config = options.model_config()
    return ckpt_accounting.step_memory(
        config,
        n_params=count_parameters(config),
        tokens=options.batch_per_rank * options.sequence_length,
        world_size=world_size,
        compiled=options.compile,
        save_attention=options.save_attention,
    )


def step_checkpoint_policy(options: StepOptions, world_size: int | None = None) -> str:
    """The concrete policy the step runs: ``keep:auto`` becomes ``keep:N``, N the most last blocks
    whose predicted peak (``accounting.checkpointing.step_memory``) fits :func:`keep_budget_bytes`.
    Every rank computes the same N (same model, same GPU kind), so the ranks' models agree."""
    if options.checkpoint != "keep:auto":
        return options.checkpoint
    world_size = world()[1] if world_size is None else world_size
    memory = predicted_step_memory(options, world_size)
    return f"keep:{ckpt_accounting.blocks_to_keep(memory, keep_budget_bytes(options))}"


# -- FLOPs: the SPEC's convention for D26 ------------------------------------------------------------


def model_flops_per_step(config: ModelConfig, batch: int, seq: int) -> float:
    """6 x matmul parameters x tokens + causal attention 6·L·S²·D per sequence (half the S² work; the
    SPEC's count, 4.74e15 for the 8B step). Embedding lookups are not matmuls and are left out."""
    d, layers = config.d_model, config.num_layers
    matmul_params = layers * (4 * d * d + 3 * d * config.d_ff) + d * config.vocab_size
    return 6.0 * matmul_params * batch * seq + 6.0 * layers * seq * seq * d * batch


# -- the model: the LM head computes the loss ---------------------------------------------------------


def _chunk_loss_sum(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, weight).float(), targets, reduction="sum")


def chunked_linear_cross_entropy(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> torch.Tensor:
    """Mean cross-entropy of ``h @ weight.T`` computed ``chunk_tokens`` rows at a time, each chunk
    checkpointed: one chunk's logits live at a time, in forward and in backward (torch-only baseline)."""
    total = h.new_zeros((), dtype=torch.float32)
    for start in range(0, h.shape[0], chunk_tokens):
        rows = slice(start, start + chunk_tokens)
        total = total + checkpoint(_chunk_loss_sum, h[rows], weight, targets[rows], use_reentrant=False)
    return total / h.shape[0]


class LossHead(Linear):
    """The untied LM head, computing the mean cross-entropy in its own forward: an FSDP unit around
    it then gathers its weight for exactly the loss computation (forward and backward)."""

    def __init__(self, d_model: int, vocab_size: int, loss: str, chunk_tokens: int, device=None, dtype=None):
        super().__init__(d_model, vocab_size, device=device, dtype=dtype)
        if loss not in LOSS_CHOICES:
            raise ValueError(f"unknown loss {loss!r}; choose one of {LOSS_CHOICES}")
        self.loss, self.chunk_tokens = loss, chunk_tokens

    def forward(self, h: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        h, targets = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
        weight = self.weight.to(h.dtype)
        if self.loss == "fused":
            from cs336_systems.kernels.fused_cross_entropy import fused_linear_cross_entropy

            return fused_linear_cross_entropy(h, weight, targets)
        if self.loss == "chunked":
            return chunked_linear_cross_entropy(h, weight, targets, self.chunk_tokens)
        return F.cross_entropy(F.linear(h, weight).float(), targets)


class StepModel(TransformerLM):
    """The Transformer LM with the loss in its forward and per-block checkpointing: the step calls
    ``model(tokens, targets)`` once, so the root module's FSDP hooks (FSDP2's lazy init and the final
    norm's gather) run as they would around any model forward.

    Where a checkpointed block's FSDP hooks run depends on the FSDP: ours gathers a unit's weights in
    the unit's forward pre-hook, so the checkpoint must wrap the module call (the backward's re-run
    calls the hooks again, which gather again); FSDP2 gathers for the backward in its own pre-backward
    hook, so the checkpoint wraps the block's forward only, inside FSDP2's hooks (torchtitan's order).
    """

    def __init__(self, config: ModelConfig, options: StepOptions, device=None):
        super().__init__(config, device=device)
        self.lm_head = LossHead(
            config.d_model, config.vocab_size, options.loss, options.loss_chunk_tokens, device=device
        )
        self.checkpoint_policy = step_checkpoint_policy(options)
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if options.save_attention:
            kwargs["context_fn"] = save_attention_context
        self.checkpointed = checkpointed_blocks(self.checkpoint_policy, config.num_layers)
        self.checkpoint_hooks = options.fsdp != "torch"
        for block, checkpointed in zip(self.layers, self.checkpointed, strict=True):
            body = torch.compile(block.forward) if options.compile else block.forward
            if checkpointed and not self.checkpoint_hooks:
                body = functools.partial(checkpoint, body, **kwargs)
            # An instance attribute: module hooks (FSDP's) stay outside the compiled / checkpointed body.
            block.forward = body
        self._checkpoint = functools.partial(checkpoint, **kwargs)

    def forward(self, token_ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = self.token_embeddings(token_ids)
        for block, checkpointed in zip(self.layers, self.checkpointed, strict=True):
            x = self._checkpoint(block, x) if checkpointed and self.checkpoint_hooks else block(x)
        return self.lm_head(self.ln_final(x), targets)


def _attention_ops() -> tuple[Any, ...]:
    """The attention forward ops whose outputs selective checkpointing keeps (ours and SDPA's)."""
    import cs336_systems.attention.flash_triton  # noqa: F401  (registers the custom op)

    aten = torch.ops.aten
    return (
        torch.ops.cs336_systems.flash_attention_fwd.default,
        aten._scaled_dot_product_flash_attention.default,
        aten._scaled_dot_product_efficient_attention.default,
        aten._scaled_dot_product_cudnn_attention.default,
    )


def save_attention_context():
    """Selective checkpointing: the re-run forward of a checkpointed block recomputes everything but
    attention, whose output and log-sum-exp are kept from the first forward. Attention is the block's
    most expensive op at long context (O(S²)); keeping its output costs S·D per block (268 MB at 8B)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = set(_attention_ops())

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def build_meta_model(options: StepOptions) -> StepModel:
    with torch.device("meta"):
        return StepModel(options.model_config(), options)


# -- materialization: unit by unit, deterministic ----------------------------------------------------


def _init_module(module: nn.Module) -> None:
    """Initialize a module's own parameters and buffers as its constructor would."""
    if isinstance(module, Linear | Embedding):
        module.reset_parameters()
    elif isinstance(module, RMSNorm):
        nn.init.ones_(module.weight)
    elif any(True for _ in module.parameters(recurse=False)) or any(
        True for _ in module.buffers(recurse=False)
    ):
        raise TypeError(f"no initialization known for {type(module).__name__}; add it to _init_module")


@torch.no_grad()
def materialize_(
    module: nn.Module, device: torch.device, seed: int, index_of: dict[int, int], recurse: bool = True
) -> None:
    """Move ``module``'s meta tensors (and its submodules', with ``recurse``) to ``device`` and
    initialize them; each module draws from a generator seeded by ``seed`` and its index in the whole
    model (``index_of``), so the values do not depend on which unit, rank or order materializes it."""
    for sub in module.modules() if recurse else [module]:
        if not any(t.is_meta for t in (*sub.parameters(recurse=False), *sub.buffers(recurse=False))):
            continue
        sub.to_empty(device=device, recurse=False)
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(seed * 1_000_003 + index_of[id(sub)])
            _init_module(sub)


def fsdp_units(model: StepModel) -> list[nn.Module]:
    """The sharding units, in forward order: embedding, each block, LM head (the root holds the rest)."""
    return [model.token_embeddings, *model.layers, model.lm_head]


def module_indices(model: nn.Module) -> dict[int, int]:
    return {id(m): i for i, m in enumerate(model.modules())}


def shard_model(model: StepModel, options: StepOptions, device: torch.device) -> nn.Module:
    """Materialize and shard ``model`` (built on meta) unit by unit; returns the module to train."""
    index_of = module_indices(model)
    # The RoPE tables are derived, not learned, and shared by every block: compute them once, first.
    config = model.config
    rope = RotaryEmbedding(config.d_head, config.context_length, config.rope_theta, device=device)
    for name in ("cos", "sin"):
        model.rope.register_buffer(name, getattr(rope, name), persistent=False)
    if options.fsdp == "none":
        materialize_(model, device, options.seed, index_of)
        return model
    if options.fsdp == "torch":
        return _shard_fsdp2(model, options, device, index_of)
    return _shard_ours(model, options, device, index_of)


def _shard_fsdp2(model: StepModel, options: StepOptions, device: torch.device, index_of: dict) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(
        param_dtype=DTYPES[options.compute_dtype], reduce_dtype=DTYPES[options.reduce_dtype]
    )
    for unit in fsdp_units(model):
        materialize_(unit, device, options.seed, index_of)
        fully_shard(unit, mp_policy=policy)
    materialize_(model, device, options.seed, index_of)  # what is left: the final norm
    fully_shard(model, mp_policy=policy)
    return model


def _shard_ours(model: StepModel, options: StepOptions, device: torch.device, index_of: dict) -> nn.Module:
    # Replicated parameters (the norm gains) are a few KB: materialize them up front.
    for sub in model.modules():
        if not is_sharded_layer(sub):
            materialize_(sub, device, options.seed, index_of, recurse=False)
    return MaterializingFSDP(
        model,
        lambda layer: materialize_(layer, device, options.seed, index_of),
        compute_dtype=DTYPES[options.compute_dtype],
        reduce_dtype=DTYPES[options.reduce_dtype],
        units=list(model.layers),
    )


class MaterializingFSDP(FSDP):
    """The suite's FSDP over a model whose sharded layers are still on the meta device: each layer is
    materialized (full, on the rank's device, deterministically initialized by ``init_layer``) right
    before FSDP cuts its row shard, so a rank holds one layer's full weight at a time. Nothing is
    broadcast: every rank initializes the same values, and a broadcast would need the full model."""

    def __init__(self, module: nn.Module, init_layer: Callable[[nn.Module], None], **kwargs: Any):
        self.__dict__["_init_layer"] = init_layer  # before nn.Module.__init__, which FSDP calls
        from cs336_systems.distributed import fsdp

        broadcast, fsdp.broadcast_module = fsdp.broadcast_module, lambda module: None
        try:
            super().__init__(module, **kwargs)
        finally:
            fsdp.broadcast_module = broadcast

    def _shard(self, sub: nn.Module, name: str, offset: int):
        self._init_layer(sub)
        return super()._shard(sub, name, offset)

    def _register_module_hooks(self) -> None:
        """Each unit swaps all its gathered weights in when it starts and out when it ends, instead of
        around each layer: a block's forward then runs no hook inside, so ``torch.compile`` of the
        block's forward sees one graph (as with FSDP2), not a graph break at every Linear."""
        for unit in self._units:
            unit.root.register_forward_pre_hook(
                lambda m, args, kwargs, u=unit: self._begin_and_swap_in(u, args, kwargs), with_kwargs=True
            )
            unit.root.register_forward_hook(lambda m, args, out, u=unit: self._swap_out_and_end(u))

    def _begin_and_swap_in(self, unit, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        # Out of every dispatch mode: selective checkpointing's mode would otherwise count the
        # gather's ops as the block's and find them different in the re-run (prefetched or not).
        with _disable_current_modes():
            self._begin_unit(unit)
            cast = None
            for k in range(len(unit.entries)):
                cast = self._swap_in(unit, k, args, kwargs) or cast  # the unit's inputs, cast once
        return cast

    def _swap_out_and_end(self, unit) -> None:
        for entry in unit.entries:
            self._swap_out(entry)
        self._end_unit(unit)


# -- optimizer ---------------------------------------------------------------------------------------


def build_optimizer(model: nn.Module, options: StepOptions) -> Any:
    params = [p for p in model.parameters() if p.requires_grad]
    kwargs = dict(lr=options.lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=options.weight_decay)
    if options.optimizer == "torch_fused":
        return torch.optim.AdamW(params, fused=True, **kwargs)
    from cs336_systems.kernels.fused_adamw import FusedAdamW

    if any(hasattr(p, "to_local") for p in params):  # FSDP2: DTensor parameters
        return OnLocalShards(params, lambda local: FusedAdamW(local, **kwargs))
    return FusedAdamW(params, **kwargs)


class OnLocalShards:
    """Steps an optimizer written for plain tensors (FusedAdamW's Triton kernel takes data pointers)
    on the local shards of DTensor parameters (FSDP2's): the shards alias the parameters' storage, and
    each step hands them the local shards of the gradients."""

    def __init__(self, params: list[torch.Tensor], make: Callable[[list[torch.Tensor]], Any]):
        self.params = params
        with torch.no_grad():
            self.local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
        self.inner = make(self.local)

    def step(self) -> None:
        for p, local in zip(self.params, self.local, strict=True):
            if local is not p:
                local.grad = None if p.grad is None else p.grad.to_local()
        self.inner.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p, local in zip(self.params, self.local, strict=True):
            p.grad = local.grad = None


# -- the step ----------------------------------------------------------------------------------------


def local_batch(options: StepOptions, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rows of one fixed global batch (``batch_per_rank`` x world size sequences)."""
    rank, world_size = world()
    gen = torch.Generator().manual_seed(options.seed + 1)
    tokens = torch.randint(
        vocab, (options.batch_per_rank * world_size, options.sequence_length + 1), generator=gen
    )
    local = shard_batch(tokens, rank, world_size).to(device)
    return local[:, :-1].contiguous(), local[:, 1:].contiguous()


class Marks:
    """Named points of one step: CUDA events on a GPU (no host sync), the host clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.points: list[Any] = []

    def __call__(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.points.append(event)
        else:
            self.points.append(time.perf_counter())

    def gaps_ms(self) -> list[float]:
        """Milliseconds between consecutive points (call after the device is synchronized)."""
        if self.cuda:
            return [a.elapsed_time(b) for a, b in itertools.pairwise(self.points)]
        return [(b - a) * 1e3 for a, b in itertools.pairwise(self.points)]


PHASES = ("forward_ms", "backward_ms", "optimizer_ms")


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    tokens: torch.Tensor,
    targets: torch.Tensor,
    mark: Callable[[], None] = lambda: None,
) -> torch.Tensor:
    """Forward with loss, backward, gradient sync, AdamW; ``mark`` is called between the phases."""
    mark()
    loss = model(tokens, targets)
    mark()
    loss.backward()
    finish = getattr(model, "finish_gradient_synchronization", None)
    if finish is not None:  # ours waits for its last reduce-scatters here; FSDP2 did inside backward
        finish()
    mark()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    mark()
    return loss.detach()


def _use_cache_dir(path: str) -> None:
    os.makedirs(path, exist_ok=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(path, "inductor")
    os.environ["TRITON_CACHE_DIR"] = os.path.join(path, "triton")


def _seconds_since_process_start() -> float | None:
    """Wall time since this process started (Linux /proc), to count the imports in the first step."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return uptime - start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def run_step(options: StepOptions) -> dict[str, Any]:
    """Rank function (torchrun or ``launch.spawn``; ``fsdp="none"`` also in a plain process): build,
    shard and materialize the model, then one first step, ``warmup`` more, ``steps`` timed ones.

    Returns this rank's numbers: ``step_ms`` and the phase split of the timed steps, ``losses`` (every
    step's), ``first_step_s``, CUDA memory peaks over the timed steps, the bf16 matmul rate of this
    GPU (the MFU denominator), and on request the top kernels of one profiled step and the parameters.
    """
    t_start = time.perf_counter()
    since_start = _seconds_since_process_start()
    if options.cache_dir:
        _use_cache_dir(options.cache_dir)
    distributed = torch.distributed.is_initialized()
    if options.fsdp != "none" and not distributed:
        raise RuntimeError(f"fsdp={options.fsdp!r} needs a process group: run under torchrun or launch.spawn")
    if options.fsdp == "none" and world()[1] > 1:
        raise ValueError("fsdp='none' trains one unsharded replica: run it in one process")
    share_cpu_threads()
    device = rank_device() if distributed else _single_device()
    _use_expandable_segments(device)
    config = options.model_config()
    meta_model = build_meta_model(options)
    checkpointed = meta_model.checkpointed
    model = shard_model(meta_model, options, device)
    optimizer = build_optimizer(model, options)
    tokens, targets = local_batch(options, config.vocab_size, device)
    world_size = world()[1]
    out: dict[str, Any] = {
        "options": asdict(options),
        "label": options.label,
        "world_size": world_size,
        "tokens_per_rank": tokens.numel(),
        "flops_per_step": model_flops_per_step(
            config, options.batch_per_rank * world_size, options.sequence_length
        ),
        "local_params": sum(p.numel() for p in _local_tensors(model)),
        "mem_after_init_mib": _allocated_mib(device),
        "checkpoint_resolved": meta_model.checkpoint_policy,  # keep:auto -> keep:N
        "checkpointed_blocks": sum(checkpointed),
        "kept_blocks": len(checkpointed) - sum(checkpointed),  # blocks not checkpointed
    }
    if options.checkpoint.startswith("keep:"):
        memory = predicted_step_memory(options, world_size)
        out["predicted_peak_gib"] = memory.peak(out["kept_blocks"]) / GIB
        out["keep_budget_gib"] = keep_budget_bytes(options) / GIB
    autocast = _autocast(options, device)
    losses = []
    with autocast:
        losses.append(train_step(model, optimizer, tokens, targets).item())  # .item() synchronizes
    out["first_step_s"] = time.perf_counter() - t_start
    out["first_step_since_process_start_s"] = (
        None if since_start is None else since_start + out["first_step_s"]
    )
    with autocast:
        for _ in range(options.warmup):
            losses.append(train_step(model, optimizer, tokens, targets).item())
    synchronize(device)
    if device.type == "cuda":  # the peak of the first steps (autotuning, compilation) on its own
        out["peak_first_steps_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    if distributed:
        barrier(device)
    step_ms, phases = [], {phase: [] for phase in PHASES}
    for _ in range(options.steps):
        marks = Marks(device)
        t0 = time.perf_counter()
        with autocast:
            loss = train_step(model, optimizer, tokens, targets, marks)
        synchronize(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        for phase, ms in zip(PHASES, marks.gaps_ms(), strict=True):
            phases[phase].append(ms)
    out.update(step_ms=step_ms, losses=losses)
    out.update({phase: statistics.fmean(v) if v else None for phase, v in phases.items()})
    if device.type == "cuda":
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
        out["matmul_tflops"] = measure_matmul_tflops(device, torch.bfloat16)
    if options.profile:
        out["profile"] = _profile_step(model, optimizer, tokens, targets, device, autocast)
    if options.return_params:
        out["params"] = full_parameters(model)
    return out


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded model's parameters by name, full shapes, on the CPU (all ranks must call it)."""
    gather = getattr(model, "gather_full_params", None)
    if gather is not None:  # ours
        return {k: v.detach().cpu() for k, v in gather().items()}
    out = {}
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p  # FSDP2 parameters are DTensors
        out[name] = full.detach().cpu()
    return out


def _local_tensors(model: nn.Module) -> list[torch.Tensor]:
    return [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]


def _use_expandable_segments(device: torch.device) -> None:
    """Segments that grow in place instead of many fixed-size ones: with un-checkpointed blocks the step
    runs near the GPU's capacity, where fixed segments left 13.6 GiB reserved but unusable (measured).
    A user's own PYTORCH_CUDA_ALLOC_CONF wins."""
    if device.type == "cuda" and not {"PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"} & set(os.environ):
        # The CUDA context exists by now, so the environment variable would be read too late.
        setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
        (setter or torch.cuda.memory._set_allocator_settings)("expandable_segments:True")


def _allocated_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / MIB if device.type == "cuda" else None


def _single_device() -> torch.device:
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def _autocast(options: StepOptions, device: torch.device) -> contextlib.AbstractContextManager:
    """Without FSDP nothing casts the weights: the unsharded model computes under autocast instead."""
    if options.fsdp == "none" and options.compute_dtype != "fp32":
        return torch.autocast(device.type, dtype=DTYPES[options.compute_dtype])
    return contextlib.nullcontext()


# Kernel name -> where the time goes (first match wins: FlashAttention's Triton kernels before GEMMs).
KERNEL_CATEGORIES = (
    ("communication", ("nccl",)),
    ("attention", ("flash", "attn", "fmha", "sdpa", "cudnn")),
    ("loss", ("cross_entropy",)),
    ("optimizer", ("adam", "multi_tensor")),
    ("matmul", ("gemm", "xmma", "cutlass", "nvjet", "wgmma", "matmul", "sm90", "splitk")),
    ("triton (compiled elementwise)", ("triton_",)),
)


def kernel_category(name: str) -> str:
    lower = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in lower for k in keys)), "other")


def _profile_step(model, optimizer, tokens, targets, device, autocast) -> dict[str, Any]:
    """One more step under torch.profiler: device time per kernel category (communication overlaps
    compute, so the categories add up to more than the step) and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, autocast:
        train_step(model, optimizer, tokens, targets)
        synchronize(device)
    # Device kernels only: user annotations ("nccl:all_reduce", "Optimizer.step#...", our FSDP's
    # "fsdp.forward[i]" ranges) carry their kernels' device time too, and would count it twice.
    annotation = ("nccl:", "fsdp.")
    kernels = [
        e
        for e in prof.key_averages()
        if e.device_type == DeviceType.CUDA and not e.key.startswith(annotation) and "#" not in e.key
    ]
    by_category: dict[str, float] = {}
    for e in kernels:
        cat = kernel_category(e.key)
        by_category[cat] = by_category.get(cat, 0.0) + e.self_device_time_total / 1e3
    top = sorted(kernels, key=lambda e: e.self_device_time_total, reverse=True)[:20]
    lines = [f"{e.self_device_time_total / 1e3:9.1f} ms {e.count:6d}x  {e.key[:90]}" for e in top]
    return {
        "kernel_ms_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
        "top_kernels": "\n".join(lines),
    }
