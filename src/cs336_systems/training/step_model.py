"""The 8B step's model: the Transformer LM whose LM head computes the loss (fused, chunked or full),
per-block checkpointing (selective: attention's output kept) and per-block compile, built on meta."""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from cs336_systems.model import ModelConfig, TransformerLM
from cs336_systems.model.checkpointing import checkpointed_blocks
from cs336_systems.model.transformer import Linear
from cs336_systems.training.options import LOSS_CHOICES, StepOptions, step_checkpoint_policy

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
        if options.save_attention or options.save_matmuls:
            kwargs["context_fn"] = functools.partial(
                selective_context, attention=options.save_attention, matmuls=options.save_matmuls
            )
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


def _matmul_ops() -> tuple[Any, ...]:
    """The ops a Linear runs as (under autocast, after ``F.linear``'s decomposition)."""
    aten = torch.ops.aten
    return (aten.mm.default, aten.addmm.default, aten.bmm.default)


def save_attention_context():
    """Selective checkpointing: the re-run forward of a checkpointed block recomputes everything but
    attention, whose output and log-sum-exp are kept from the first forward. Attention is the block's
    most expensive op at long context (O(S²)); keeping its output costs S·D per block (268 MB at 8B)."""
    return selective_context(attention=True, matmuls=False)


def selective_context(attention: bool, matmuls: bool):
    """Selective checkpointing's contexts: the re-run keeps (does not recompute) attention's outputs
    and/or every matmul's output, and recomputes the rest."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    keep = set((_attention_ops() if attention else ()) + (_matmul_ops() if matmuls else ()))

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        return CheckpointPolicy.MUST_SAVE if op in keep else CheckpointPolicy.PREFER_RECOMPUTE

    return create_selective_checkpoint_contexts(policy)


def build_meta_model(options: StepOptions) -> StepModel:
    with torch.device("meta"):
        return StepModel(options.model_config(), options)
