"""The mechanics under :class:`cs336_systems.distributed.fsdp.FSDP`: which layers are sharded, how a
weight is cut into row shards, and the flat buffers one communication unit sends and receives.

A unit is the set of sharded weights that travel together (one layer, or every layer of a block):
its shards sit back to back in one per-rank flat buffer, so the unit needs one all-gather and one
reduce-scatter. Nothing here keeps state between steps; the container decides when each runs.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

# torch >= 2.12 names them *_single (the *_tensor forms warn that they are deprecated).
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def is_sharded_layer(module: nn.Module) -> bool:
    """A Linear or an Embedding (by class or class name) with a 2-D ``weight`` parameter."""
    names = [cls.__name__ for cls in type(module).__mro__]
    is_kind = isinstance(module, nn.Linear | nn.Embedding) or any(
        n.endswith(("Linear", "Embedding")) for n in names
    )
    weight = module._parameters.get("weight")
    return is_kind and isinstance(weight, nn.Parameter) and weight.dim() == 2


def profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A named profiler range while the profiler runs; nothing otherwise (it costs µs per unit)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class CommCall:
    """One collective FSDP issued (recorded while ``FSDP.comm_log`` is a list): what a test can check
    about precision and volume without patching the collectives."""

    op: str  # "all_gather" or "reduce_scatter"
    unit: int
    dtype: torch.dtype  # of the tensor this rank sends
    send_bytes: int
    recv_bytes: int


@dataclass
class Entry:
    """One sharded weight: the layer, its qualified name, its row shard and the full shape."""

    module: nn.Module
    name: str
    shard: nn.Parameter
    shape: torch.Size
    offset: int  # element offset inside the unit's per-rank flat buffer
    extras: dict[str, nn.Parameter] = field(default_factory=dict)  # the layer's other params (bias)

    @property
    def rows(self) -> int:
        return self.shard.shape[0]


@dataclass
class Pending:
    work: Any
    out: torch.Tensor
    keep: torch.Tensor  # the send buffer, alive until the call is waited on
    done: torch.cuda.Event | None = None  # CUDA: recorded on the gather stream when ``out`` is full


@dataclass
class Unit:
    index: int
    root: nn.Module
    entries: list[Entry]
    numel: int  # per-rank flat elements
    fwd: list[torch.Tensor] | None = None  # full weights while the forward uses them
    fwd_pending: Pending | None = None
    bwd: list[torch.Tensor] | None = None  # storage-owning tensors gathered for the backward
    bwd_pending: Pending | None = None
    needs_bwd_gather: bool = False
    launched: bool = False  # this backward's reduce-scatter is out
    expected: list[int] = field(default_factory=list)  # forward uses per entry (grad arrivals due)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.reset_grads()

    @property
    def trainable(self) -> bool:
        return any(e.shard.requires_grad for e in self.entries)

    def reset_grads(self) -> None:
        """Forget this backward's gradient bookkeeping (a new graph, or after synchronization)."""
        self.expected = [0] * len(self.entries)
        self.received = [0] * len(self.entries)
        self.grads = [None] * len(self.entries)


@dataclass
class SavedWeight:
    """What autograd keeps instead of a tensor that lives in a gathered weight."""

    unit: Unit
    k: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


def tied_weight_error(names: list[str]) -> ValueError:
    return ValueError(
        f"FSDP does not support tied weights: {' and '.join(names)} are one parameter; untie them "
        "(e.g. clone the LM head from the embedding) before wrapping"
    )


def group_layers(
    module: nn.Module, roots: list[nn.Module]
) -> list[tuple[nn.Module, list[tuple[str, nn.Module]]]]:
    """(unit root, [(weight name, layer)]) for every unit, in registration order: the layers under a
    listed root form its unit; any other sharded layer is a unit of its own."""
    slots: dict[int, list[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        slots.setdefault(id(p), []).append(name)
    root_of: dict[int, nn.Module] = {}
    for root in roots:
        for sub in root.modules():
            root_of.setdefault(id(sub), root)
    grouped: dict[int, tuple[nn.Module, list[tuple[str, nn.Module]]]] = {}
    for name, sub in module.named_modules():
        if not is_sharded_layer(sub):
            continue
        if len(slots[id(sub._parameters["weight"])]) > 1:
            raise tied_weight_error(slots[id(sub._parameters["weight"])])
        root = root_of.get(id(sub), sub)
        grouped.setdefault(id(root), (root, []))[1].append((f"{name}.weight" if name else "weight", sub))
    return list(grouped.values())


@torch.no_grad()
def cut_shard(sub: nn.Module, name: str, offset: int, rank: int, world_size: int) -> Entry:
    """Replace the layer's full weight by this rank's row shard (zero-padded to a multiple of the
    world size); the full weight is freed with its last reference."""
    full = sub._parameters["weight"]
    rows = -(-full.shape[0] // world_size)
    padded = full.new_zeros((rows * world_size, *full.shape[1:]))
    padded[: full.shape[0]] = full
    shard = nn.Parameter(padded[rank * rows : (rank + 1) * rows].clone(), requires_grad=full.requires_grad)
    sub._parameters["weight"] = shard
    extras = {n: q for n, q in sub._parameters.items() if n != "weight" and q is not None}
    return Entry(sub, name, shard, full.shape, offset, extras)


def gather_send_buffer(unit: Unit, dtype: torch.dtype) -> torch.Tensor:
    """The unit's shards as one flat buffer in ``dtype``: cast before communicating, so a
    low-precision compute dtype halves the all-gather's bytes."""
    if len(unit.entries) == 1:
        return unit.entries[0].shard.to(dtype).reshape(-1)
    send = torch.empty(unit.numel, dtype=dtype, device=unit.entries[0].shard.device)
    for e in unit.entries:
        send[e.offset : e.offset + e.shard.numel()].copy_(e.shard.reshape(-1))
    return send


def full_weights(unit: Unit, out: torch.Tensor, world_size: int) -> list[torch.Tensor]:
    """Each entry's full weight (padding rows dropped) from the unit's gathered buffer: a view of
    it for a one-layer unit, a contiguous copy per entry otherwise (the ranks' blocks interleave)."""
    if len(unit.entries) == 1:
        e = unit.entries[0]
        return [out.view(e.rows * world_size, *e.shape[1:])[: e.shape[0]]]
    per_rank = out.view(world_size, unit.numel)
    fulls = []
    for e in unit.entries:
        block = per_rank[:, e.offset : e.offset + e.shard.numel()]
        fulls.append(block.reshape(e.rows * world_size, *e.shape[1:])[: e.shape[0]].contiguous())
    return fulls


@torch.no_grad()
def scatter_send_buffer(unit: Unit, dtype: torch.dtype, world_size: int) -> torch.Tensor:
    """The unit's full gradients, padded and laid out rank by rank, in ``dtype`` (the reduce
    dtype): the input of its reduce-scatter."""
    e0, g0 = unit.entries[0], unit.grads[0]
    if len(unit.entries) == 1 and e0.shape[0] == e0.rows * world_size:
        return g0.to(dtype).contiguous().view(-1)  # no padding: communicate the gradient itself
    flat = g0.new_zeros((world_size, unit.numel), dtype=dtype)
    for e, g in zip(unit.entries, unit.grads, strict=True):
        if g is None:
            continue
        padded = g.new_zeros((world_size * e.rows, *e.shape[1:]), dtype=dtype)
        padded[: e.shape[0]].copy_(g)
        flat[:, e.offset : e.offset + e.shard.numel()].copy_(padded.view(world_size, -1))
    return flat.view(-1)


@torch.no_grad()
def add_shard_grads(unit: Unit, reduced: torch.Tensor) -> None:
    """Accumulate the unit's reduced (already averaged) flat shard into each used entry's ``.grad``,
    in the shard's own dtype."""
    for e, used in zip(unit.entries, unit.expected, strict=True):
        if not used or not e.shard.requires_grad:
            continue
        g = reduced[e.offset : e.offset + e.shard.numel()].view_as(e.shard).to(e.shard.dtype)
        e.shard.grad = g.clone() if e.shard.grad is None else e.shard.grad.add_(g)
