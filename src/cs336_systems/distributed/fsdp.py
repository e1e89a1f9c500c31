"""D23: fully-sharded data parallelism, written here (not torch's FSDP).

Public API
----------
``FSDP(module, compute_dtype=None, reduce_dtype=None, units=None, prefetch=2)``

- ``module``: the model, on this rank's device (CPU under gloo, the rank's GPU under nccl), the same
  architecture on every rank; rank 0's values are broadcast at wrap time.
- ``compute_dtype``: dtype the sharded weights are cast to *before* they are all-gathered, and that
  floating inputs of the sharded layers are cast to (e.g. ``torch.bfloat16``); ``None`` computes in
  the parameters' dtype. Master shards, their gradients and the optimizer state keep the
  parameters' dtype (fp32).
- ``reduce_dtype``: dtype gradients are reduce-scattered in (default: the parameters' dtype).
- ``units``: optional list of submodules; each becomes one communication unit (one flat all-gather
  and one reduce-scatter for all the Linear/Embedding weights inside it, e.g. one per transformer
  block). Sharded layers outside every listed unit (embedding, LM head) are units of their own.
  Default ``None``: one unit per Linear/Embedding layer (the course contract).
- ``prefetch``: how many units ahead (in the recorded forward order) the forward all-gathers run;
  the handout allows at most 2. The backward prefetches ``max(prefetch, 1)`` units ahead in
  reverse order.

Methods and attributes: ``forward(*args, **kwargs)`` (call the model through this);
``finish_gradient_synchronization()`` (after ``backward``: waits for the reduce-scatters and
all-reduces, divides by the world size and leaves a ``.grad`` of the parameter's own shape and dtype
on every trainable parameter); ``gather_full_params() -> {name: full tensor}`` (keyed by the
unwrapped model's names); ``.module`` (the wrapped model); ``parameters()`` / ``.module.named_parameters()``
(the local shards of the sharded weights, the full replicated parameters, so any ``torch.optim``
optimizer steps only the shard); ``.trace`` (set to a list to record
``(event, unit_index)`` tuples: ``gather`` when an all-gather is launched, ``fwd_start`` /
``fwd_end`` around a unit's forward, ``bwd_gather`` for a gather of the backward).

What is sharded: the ``weight`` of every module that is a Linear or an Embedding (``nn.Linear``,
``nn.Embedding``, their subclasses, and any class whose name ends in ``Linear`` or ``Embedding``)
and has a 2-D ``weight`` parameter, split by rows (dim 0) and zero-padded to a multiple of the world
size. Everything else (biases, norm gains) is replicated; its gradients are all-reduced (identical
on every rank). A sharded weight shared with another parameter slot (tied weights) is refused.

How the weight reaches the layer: a forward pre-hook swaps the layer's ``weight`` for the gathered
full tensor (the output of an autograd function whose backward launches the async reduce-scatter of
that gradient) and a post-hook swaps the shard back and drops the full tensor. Saved-tensor hooks
around ``forward`` replace every saved tensor that lives in a gathered weight's storage by a handle
(so autograd does not keep the weight alive); the backward gathers it again on first use and frees
it once the layer's gradient is out. Any module that reads ``self.weight`` in its forward works
(einsum, ``F.linear``, an autograd function or Triton kernel that saves the weight), and so does
non-reentrant activation checkpointing: a re-run forward inside the backward gathers again, without
forward prefetch.

Streams (CUDA): all-gathers (with their cast / copy-in) run on a dedicated high-priority stream; it
waits on the compute stream at each launch (so buffers the host has dropped may be reused, without
``record_stream``), and the compute stream waits on the gather's completion event just before the
unit's forward or backward uses the weights. Under gloo the gathers are waited on by the host.
Replicated gradients are all-reduced as one flat buffer per dtype in
``finish_gradient_synchronization`` (they are small: one collective each would cost more than the
bytes). With the profiler on, ``fsdp.allgather[i]`` / ``fsdp.forward[i]`` ranges name each unit's
gather and forward (``overlap.unit_readiness`` reads them).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.distributed.comm import broadcast_module, require_process_group, world

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


def _profiler_range(name: str) -> contextlib.AbstractContextManager:
    """A named profiler range while the profiler runs; nothing otherwise (it costs µs per unit)."""
    if torch.autograd.profiler._is_profiler_enabled:
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Entry:
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
class _Pending:
    work: Any
    out: torch.Tensor
    keep: torch.Tensor  # the send buffer, alive until the call is waited on
    done: torch.cuda.Event | None = None  # CUDA: recorded on the gather stream when ``out`` is full


@dataclass
class _Unit:
    index: int
    root: nn.Module
    entries: list[_Entry]
    numel: int  # per-rank flat elements
    fwd: list[torch.Tensor] | None = None  # full weights while the forward uses them
    fwd_pending: _Pending | None = None
    bwd: list[torch.Tensor] | None = None  # storage-owning tensors gathered for the backward
    bwd_pending: _Pending | None = None
    needs_bwd_gather: bool = False
    launched: bool = False  # this backward's reduce-scatter is out
    expected: list[int] = field(default_factory=list)  # forward uses per entry (grad arrivals due)
    grads: list[torch.Tensor | None] = field(default_factory=list)
    received: list[int] = field(default_factory=list)

    @property
    def trainable(self) -> bool:
        return any(e.shard.requires_grad for e in self.entries)


@dataclass
class _SavedWeight:
    """What autograd keeps instead of a tensor that lives in a gathered weight."""

    unit: _Unit
    k: int
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Gather(torch.autograd.Function):
    """shard -> full weight; the backward hands the full gradient to the unit (which reduce-scatters
    it asynchronously) and returns no gradient: the shard's ``.grad`` is set on synchronization."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: FSDP, unit: _Unit, k: int) -> torch.Tensor:
        ctx.fsdp, ctx.unit, ctx.k = fsdp, unit, k
        return unit.fwd[k].view_as(unit.fwd[k])

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None, None, None]:
        ctx.fsdp._on_grad(ctx.unit, ctx.k, grad)
        return None, None, None, None


class FSDP(nn.Module):
    """See the module docstring."""

    def __init__(
        self,
        module: nn.Module,
        compute_dtype: torch.dtype | None = None,
        reduce_dtype: torch.dtype | None = None,
        units: Iterable[nn.Module] | None = None,
        prefetch: int = 2,
    ):
        super().__init__()
        require_process_group(type(self).__name__)
        if prefetch < 0:
            raise ValueError(f"prefetch must be >= 0, got {prefetch}")
        self.module = module
        self.rank, self.world_size = world()
        self.compute_dtype = compute_dtype
        self.reduce_dtype = reduce_dtype
        self.prefetch = prefetch
        self.trace: list[tuple[str, int]] | None = None
        broadcast_module(module)
        self._units = self._build_units(module, list(units or []))
        self._order = list(self._units)  # forward order: registration order until one is recorded
        self._recorded: list[_Unit] = []
        self._live: dict[int, tuple[_Unit, int]] = {}  # storage ptr of a gathered weight -> (unit, k)
        self._rs_pending: list[tuple[_Pending, _Unit]] = []
        self._bwd_seen: set[int] = set()
        self._fwd_ranges: dict[int, Any] = {}  # unit index -> open profiler range of its forward
        device = next((e.shard.device for u in self._units for e in u.entries), torch.device("cpu"))
        # CUDA: gathers on their own stream so they run beside the compute stream (gloo: synchronous)
        self._gather_stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self._full_storages: list[weakref.ref] = []  # for tests: every gathered buffer's storage
        sharded = {id(e.shard) for u in self._units for e in u.entries}
        self._replicated = [p for p in module.parameters() if id(p) not in sharded and p.requires_grad]
        self._register_module_hooks()

    # ---- construction -------------------------------------------------------------------------
    def _build_units(self, module: nn.Module, roots: list[nn.Module]) -> list[_Unit]:
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
            weight = sub._parameters["weight"]
            if len(slots[id(weight)]) > 1:
                raise ValueError(
                    f"FSDP does not support tied weights: {' and '.join(slots[id(weight)])} are one "
                    "parameter; untie them (e.g. clone the LM head from the embedding) before wrapping"
                )
            root = root_of.get(id(sub), sub)
            grouped.setdefault(id(root), (root, []))[1].append((f"{name}.weight" if name else "weight", sub))
        units = []
        for index, (root, layers) in enumerate(grouped.values()):
            entries, offset = [], 0
            for name, sub in layers:
                entry = self._shard(sub, name, offset)
                entries.append(entry)
                offset += entry.shard.numel()
            units.append(
                _Unit(
                    index,
                    root,
                    entries,
                    offset,
                    expected=[0] * len(entries),
                    grads=[None] * len(entries),
                    received=[0] * len(entries),
                )
            )
        return units

    @torch.no_grad()
    def _shard(self, sub: nn.Module, name: str, offset: int) -> _Entry:
        full = sub._parameters["weight"]
        rows = -(-full.shape[0] // self.world_size)
        padded = full.new_zeros((rows * self.world_size, *full.shape[1:]))
        padded[: full.shape[0]] = full
        shard = nn.Parameter(
            padded[self.rank * rows : (self.rank + 1) * rows].clone(), requires_grad=full.requires_grad
        )
        sub._parameters["weight"] = shard  # the full weight is freed with its last reference
        extras = {n: q for n, q in sub._parameters.items() if n != "weight" and q is not None}
        return _Entry(sub, name, shard, full.shape, offset, extras)

    def _register_module_hooks(self) -> None:
        for unit in self._units:
            unit.root.register_forward_pre_hook(lambda m, a, u=unit: self._begin_unit(u))
            for k, entry in enumerate(unit.entries):
                entry.module.register_forward_pre_hook(
                    lambda m, a, kw, u=unit, k=k: self._swap_in(u, k, a, kw), with_kwargs=True
                )
                entry.module.register_forward_hook(lambda m, a, o, e=entry: self._swap_out(e))
            unit.root.register_forward_hook(lambda m, a, o, u=unit: self._end_unit(u))

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if not _in_backward() and torch.is_grad_enabled():
            self._start_iteration()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if not _in_backward():
            for unit in self._units:  # a prefetch the forward never used
                if unit.fwd_pending is not None:
                    self._wait_gather(unit.fwd_pending)
                    unit.fwd_pending = None
            seen = {id(u) for u in self._recorded}
            self._order = self._recorded + [u for u in self._units if id(u) not in seen]
        return out

    def _start_iteration(self) -> None:
        """A new forward: a new graph. Reduce-scatters already launched stay queued for
        ``finish_gradient_synchronization`` (so two backwards before it accumulate)."""
        self._recorded = []
        self._bwd_seen.clear()
        self.live_gathered_buffers()  # prunes the weak references of freed buffers
        for unit in self._units:
            if unit.bwd_pending is not None:
                self._wait_gather(unit.bwd_pending)
            unit.needs_bwd_gather = unit.launched = False
            unit.bwd = unit.bwd_pending = None
            unit.expected = [0] * len(unit.entries)
            unit.received = [0] * len(unit.entries)
            unit.grads = [None] * len(unit.entries)

    def _begin_unit(self, unit: _Unit) -> None:
        if self.trace is not None:
            self.trace.append(("fwd_start", unit.index))
        if torch.autograd.profiler._is_profiler_enabled and unit.index not in self._fwd_ranges:
            # entered here, left in _end_unit: the range spans the unit's forward (overlap.unit_readiness)
            rf = torch.profiler.record_function(f"fsdp.forward[{unit.index}]")
            rf.__enter__()
            self._fwd_ranges[unit.index] = rf
        if _in_backward():  # a checkpointed block re-running its forward
            unit.fwd = self._backward_bases(unit)
            return
        if all(u is not unit for u in self._recorded):
            self._recorded.append(unit)
        hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        if torch.is_grad_enabled() and (hooks is None or hooks[0] != self._pack):
            unit.needs_bwd_gather = True  # e.g. checkpointed: the backward re-runs this forward
        pending = unit.fwd_pending or self._launch_gather(unit)
        unit.fwd_pending = None
        for nxt in self._next_units(unit):
            if nxt.fwd is None and nxt.fwd_pending is None:
                nxt.fwd_pending = self._launch_gather(nxt)
        unit.fwd = self._materialize(unit, pending)
        for k, t in enumerate(unit.fwd):
            self._live[t.untyped_storage().data_ptr()] = (unit, k)

    def _next_units(self, unit: _Unit) -> list[_Unit]:
        pos = next((i for i, u in enumerate(self._order) if u is unit), None)
        return [] if pos is None else self._order[pos + 1 : pos + 1 + self.prefetch]

    def _swap_in(self, unit: _Unit, k: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        entry = unit.entries[k]
        if unit.fwd is None:  # e.g. a checkpoint re-running a block's inner function, not the block
            self._begin_unit(unit)
        if torch.is_grad_enabled() and entry.shard.requires_grad and not _in_backward():
            unit.expected[k] += 1
        entry.module._parameters["weight"] = _Gather.apply(entry.shard, self, unit, k)
        if self.compute_dtype is None:
            return None
        for n, q in entry.extras.items():  # e.g. the bias joins the layer's compute dtype
            if q.is_floating_point():
                entry.module._parameters[n] = q.to(self.compute_dtype)
        cast = lambda x: x.to(self.compute_dtype) if torch.is_tensor(x) and x.is_floating_point() else x
        return tuple(cast(a) for a in args), {n: cast(v) for n, v in kwargs.items()}

    def _swap_out(self, entry: _Entry) -> None:
        entry.module._parameters["weight"] = entry.shard
        entry.module._parameters.update(entry.extras)

    def _end_unit(self, unit: _Unit) -> None:
        if self.trace is not None:
            self.trace.append(("fwd_end", unit.index))
        rf = self._fwd_ranges.pop(unit.index, None)
        if rf is not None:
            rf.__exit__(None, None, None)
        for t in unit.fwd or []:
            self._live.pop(t.untyped_storage().data_ptr(), None)
        unit.fwd = None
        if _in_backward():  # the re-run forward's saved tensors hold what the backward needs
            unit.bwd = None

    # ---- communication ------------------------------------------------------------------------
    @torch.no_grad()
    def _launch_gather(self, unit: _Unit, phase: str = "gather") -> _Pending:
        if self.trace is not None:
            self.trace.append((phase, unit.index))
        with _profiler_range(f"fsdp.{'allgather' if phase == 'gather' else 'bwd_allgather'}[{unit.index}]"):
            if self._gather_stream is None:
                return self._issue_gather(unit)
            # Event-based reuse (as FSDP2, no record_stream): every use of an earlier gathered
            # buffer that the host has dropped is queued on the compute stream before this event,
            # and every allocation on the gather stream comes after the wait, so the allocator may
            # hand that memory to this gather; the event also orders the gather after the optimizer.
            compute = torch.cuda.current_stream(self._gather_stream.device)
            self._gather_stream.wait_stream(compute)
            with torch.cuda.stream(self._gather_stream):
                pending = self._issue_gather(unit)
                pending.work.wait()  # the gather stream waits for NCCL's; the host does not
                pending.done = torch.cuda.Event()
                pending.done.record(self._gather_stream)
            return pending

    def _issue_gather(self, unit: _Unit) -> _Pending:
        dtype = self.compute_dtype or unit.entries[0].shard.dtype
        if len(unit.entries) == 1:
            send = unit.entries[0].shard.to(dtype).reshape(-1)  # cast before communicating
        else:
            send = torch.empty(unit.numel, dtype=dtype, device=unit.entries[0].shard.device)
            for e in unit.entries:
                send[e.offset : e.offset + e.shard.numel()].copy_(e.shard.reshape(-1))
        out = send.new_empty(unit.numel * self.world_size)
        return _Pending(_all_gather(out, send, async_op=True), out, send)

    @staticmethod
    def _wait_gather(pending: _Pending) -> None:
        """The compute stream (or, without one, the host) waits until the gathered buffer is full."""
        if pending.done is None:
            pending.work.wait()
        else:
            torch.cuda.current_stream(pending.out.device).wait_event(pending.done)

    def _materialize(self, unit: _Unit, pending: _Pending) -> list[torch.Tensor]:
        """Wait for a gather and return each entry's full weight (trimmed of its padding rows)."""
        self._wait_gather(pending)
        out = pending.out
        self._full_storages.append(weakref.ref(out.untyped_storage()))
        if len(unit.entries) == 1:
            e = unit.entries[0]
            return [out.view(e.rows * self.world_size, *e.shape[1:])[: e.shape[0]]]
        per_rank = out.view(self.world_size, unit.numel)
        fulls = []
        for e in unit.entries:
            block = per_rank[:, e.offset : e.offset + e.shard.numel()]
            full = block.reshape(e.rows * self.world_size, *e.shape[1:])[: e.shape[0]].contiguous()
            self._full_storages.append(weakref.ref(full.untyped_storage()))
            fulls.append(full)
        return fulls

    def _backward_bases(self, unit: _Unit) -> list[torch.Tensor]:
        """The unit's weights for the backward: gathered once (or taken from the prefetch), and the
        previous unit of the forward order prefetched behind it."""
        if unit.bwd is None:
            pending = unit.bwd_pending or self._launch_gather(unit, "bwd_gather")
            unit.bwd_pending = None
            self._bwd_seen.add(unit.index)
            for prev in self._previous_needing_gather(unit, max(self.prefetch, 1)):
                prev.bwd_pending = self._launch_gather(prev, "bwd_gather")
                self._bwd_seen.add(prev.index)
            unit.bwd = self._materialize(unit, pending)
        return unit.bwd

    def _previous_needing_gather(self, unit: _Unit, ahead: int) -> list[_Unit]:
        """Of the next ``ahead`` units the backward will gather for (reverse forward order), those
        not gathered or prefetched yet."""
        pos = next((i for i, u in enumerate(self._recorded) if u is unit), None)
        out, considered = [], 0
        for prev in reversed(self._recorded[:pos] if pos is not None else []):
            if not prev.needs_bwd_gather:
                continue
            if prev.index not in self._bwd_seen:
                out.append(prev)
            considered += 1
            if considered >= ahead:
                break
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        if not self._live or t.layout != torch.strided:
            return t
        hit = self._live.get(t.untyped_storage().data_ptr())
        if hit is None or t.dtype != hit[0].fwd[hit[1]].dtype:
            return t
        unit, k = hit
        unit.needs_bwd_gather = True
        return _SavedWeight(unit, k, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, _SavedWeight):
            return saved
        base = self._backward_bases(saved.unit)[saved.k]
        if not saved.unit.trainable:  # no gradient will arrive to say it is no longer needed
            saved.unit.bwd = None
        return base.as_strided(saved.size, saved.stride, saved.offset)

    def _on_grad(self, unit: _Unit, k: int, grad: torch.Tensor) -> None:
        unit.grads[k] = grad if unit.grads[k] is None else unit.grads[k] + grad
        unit.received[k] += 1
        if any(r < x for r, x in zip(unit.received, unit.expected, strict=True)):
            return
        unit.bwd = unit.fwd = None  # every use of the gathered weight has run its backward
        for e in unit.entries:  # a checkpoint re-run may stop early, before our post-forward hooks
            self._swap_out(e)
        self._launch_reduce_scatter(unit)

    @torch.no_grad()
    def _launch_reduce_scatter(self, unit: _Unit) -> None:
        unit.launched = True
        dtype = self.reduce_dtype or unit.entries[0].shard.dtype
        e0, g0 = unit.entries[0], unit.grads[0]
        if len(unit.entries) == 1 and e0.shape[0] == e0.rows * self.world_size:
            send = g0.to(dtype).contiguous().view(-1)  # no padding: communicate the gradient itself
        else:
            flat = g0.new_zeros((self.world_size, unit.numel), dtype=dtype)
            for e, g in zip(unit.entries, unit.grads, strict=True):
                if g is None:
                    continue
                padded = g.new_zeros((self.world_size * e.rows, *e.shape[1:]), dtype=dtype)
                padded[: e.shape[0]].copy_(g)
                flat[:, e.offset : e.offset + e.shard.numel()].copy_(padded.view(self.world_size, -1))
            send = flat.view(-1)
        unit.grads = [None] * len(unit.entries)
        out = send.new_empty(unit.numel)
        self._rs_pending.append((_Pending(_reduce_scatter(out, send, async_op=True), out, send), unit))
        while len(self._rs_pending) > 2:  # bound the full-size gradients held by calls in flight
            self._finish_reduce_scatter(*self._rs_pending.pop(0))

    @torch.no_grad()
    def _finish_reduce_scatter(self, pending: _Pending, unit: _Unit) -> None:
        pending.work.wait()
        pending.out.div_(self.world_size)
        for e, used in zip(unit.entries, unit.expected, strict=True):
            if not used or not e.shard.requires_grad:
                continue
            g = pending.out[e.offset : e.offset + e.shard.numel()].view_as(e.shard).to(e.shard.dtype)
            e.shard.grad = g.clone() if e.shard.grad is None else e.shard.grad.add_(g)

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Wait for this backward's reduce-scatters and all-reduces; leave averaged gradients."""
        self._all_reduce_replicated()
        while self._rs_pending:
            self._finish_reduce_scatter(*self._rs_pending.pop(0))
        incomplete = [u.entries[0].name for u in self._units if any(u.received) and not u.launched]
        for unit in self._units:
            for e in unit.entries:
                self._swap_out(e)
            unit.fwd = None
            if unit.bwd_pending is not None:  # a backward prefetch nobody used
                self._wait_gather(unit.bwd_pending)
        for unit in self._units:
            unit.expected = [0] * len(unit.entries)
            unit.received = [0] * len(unit.entries)
            unit.grads = [None] * len(unit.entries)
            unit.bwd = unit.bwd_pending = None
            unit.launched = False
        if incomplete:
            raise RuntimeError(
                f"the backward did not reach every use of {incomplete}; gradients are incomplete"
            )

    def _all_reduce_replicated(self) -> None:
        """One flat all-reduce per dtype for every replicated gradient (norm gains, biases): a
        collective per parameter means hundreds of tiny NCCL kernels each holding SMs. Launched
        before the reduce-scatters are waited on, so it runs behind them."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in self._replicated:
            if p.grad is not None:  # every rank alike: the same graph reached it or not
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            flat.div_(self.world_size)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()

    # ---- inspection ---------------------------------------------------------------------------
    @torch.no_grad()
    def gather_full_params(self, grads: bool = False) -> dict[str, torch.Tensor]:
        """Full parameters (fp32 masters, padding dropped) keyed by the unwrapped model's names; with
        ``grads=True`` their gradients instead (parameters without one are left out). Collective."""
        sharded = {id(e.shard): e for u in self._units for e in u.entries}
        full: dict[str, torch.Tensor] = {}
        for name, p in self.module.named_parameters():
            t = p.grad if grads else p.detach()
            e = sharded.get(id(p))
            if e is not None and (not grads or e.shard.requires_grad):
                if t is None:  # every rank's shard lacks it alike (one backward reached it or not)
                    continue
                out = t.new_empty((e.rows * self.world_size, *e.shape[1:]))
                _all_gather(out, t.contiguous())
                full[name] = out[: e.shape[0]].clone()
            elif t is not None:
                full[name] = t.clone()
        return full

    def live_gathered_buffers(self) -> int:
        """How many gathered weight buffers are still allocated (0 between steps)."""
        self._full_storages = [r for r in self._full_storages if r() is not None]
        return len(self._full_storages)

    def shard_names(self) -> list[str]:
        return [e.name for u in self._units for e in u.entries]
