"""D24(a): the expected peak-memory saving of FSDP over DDP, per rank, for the suite's FSDP.

DDP keeps on every rank the fp32 parameters, their fp32 gradients and AdamW's two fp32 moments:
16 bytes per parameter. FSDP keeps 1/N of each (the sharded Linear/Embedding weights are padded to a
multiple of N rows; the replicated norm gains are whole on every rank) plus a working set of
gathered weights: in the forward the running unit and ``prefetch`` units ahead, each in the compute
dtype; in the backward the running unit and the one prefetched behind it, the running unit's full
gradient in the compute dtype and up to two full gradients in the reduce dtype in flight. Activations
are the same for both and cancel. The saving is DDP's state minus FSDP's state minus the working set.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from cs336_systems.distributed.fsdp import is_sharded_layer
from cs336_systems.model import ModelConfig, TransformerLM, get_preset

STATE_BYTES_PER_PARAM = 16  # fp32 parameter, gradient, AdamW exp_avg and exp_avg_sq


@dataclass(frozen=True)
class FSDPSaving:
    preset: str
    world_size: int
    num_params: int
    sharded_params: int  # in Linear/Embedding weights
    largest_unit: int  # parameters of the largest per-layer unit
    ddp_state_bytes: int
    fsdp_state_bytes: int
    working_set_bytes: int  # peak of gathered weights and full gradients alive at once
    saving_bytes: int
    saving_share: float  # of DDP's state bytes


def _layer_sizes(model: nn.Module) -> list[tuple[int, ...]]:
    return [tuple(m.weight.shape) for m in model.modules() if is_sharded_layer(m)]


def fsdp_saving(
    config: ModelConfig | str = "xl",
    world_size: int = 2,
    compute_bytes: int = 2,
    reduce_bytes: int = 4,
    prefetch: int = 2,
) -> FSDPSaving:
    """Per-rank bytes of DDP vs FSDP (one unit per Linear/Embedding) for AdamW training."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    config = get_preset(config) if isinstance(config, str) else config
    model = TransformerLM(config, device="meta")
    total = sum(p.numel() for p in model.parameters())
    shapes = _layer_sizes(model)
    sharded = sum(rows * cols for rows, cols in shapes)
    padded_shard = sum(-(-rows // world_size) * cols for rows, cols in shapes)
    largest = max(rows * cols for rows, cols in shapes)
    fsdp_state = STATE_BYTES_PER_PARAM * (padded_shard + total - sharded)
    forward = (1 + prefetch) * largest * compute_bytes
    backward = 2 * largest * compute_bytes + largest * compute_bytes + 2 * largest * reduce_bytes
    working = max(forward, backward) if world_size > 1 else 0
    ddp_state = STATE_BYTES_PER_PARAM * total
    saving = ddp_state - fsdp_state - working
    return FSDPSaving(
        preset=config.name,
        world_size=world_size,
        num_params=total,
        sharded_params=sharded,
        largest_unit=largest,
        ddp_state_bytes=ddp_state,
        fsdp_state_bytes=fsdp_state,
        working_set_bytes=working,
        saving_bytes=saving,
        saving_share=saving / ddp_state,
    )
