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
on every trainable parameter); ``on_unit_grads`` (set to a callable: called with a unit's index as
soon as that unit's shard gradients are final, inside the backward or in the synchronization, e.g.
to step the optimizer there; ``unit_shards()`` / ``replicated_parameters()`` say what is whose); ``gather_full_params() -> {name: full tensor}`` (keyed by the
unwrapped model's names); ``.module`` (the wrapped model); ``parameters()`` / ``.module.named_parameters()``
(the local shards of the sharded weights, the full replicated parameters, so any ``torch.optim``
optimizer steps only the shard); ``.trace`` (set to a list to record
``(event, unit_index)`` tuples: ``gather`` when an all-gather is launched, ``fwd_start`` /
``fwd_end`` around a unit's forward, ``bwd_gather`` for a gather of the backward, ``bwd_ready``
when the backward first takes a unit's gathered weights, ``reduce_scatter`` when a unit's gradient
goes out); ``.comm_log`` (set to a list to record a :class:`CommCall` per collective: its dtype
and bytes). The mechanics (units, shards, flat buffers) live in ``fsdp_units``.

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

import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.distributed import fsdp_units as fu
from cs336_systems.distributed.comm import broadcast_module, require_process_group, world
from cs336_systems.distributed.fsdp_units import (
    CommCall,
    Pending,
    SavedWeight,
    Unit,
    in_backward,
    is_sharded_layer,
    profiler_range,
)

__all__ = ["FSDP", "CommCall", "is_sharded_layer"]


class _Gather(torch.autograd.Function):
    """shard -> full weight; the backward hands the full gradient to the unit (which reduce-scatters
    it asynchronously) and returns no gradient: the shard's ``.grad`` is set on synchronization."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, fsdp: FSDP, unit: Unit, k: int) -> torch.Tensor:
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
        # Called with a unit's index once its shards' ``.grad`` are final (reduce-scatter waited on,
        # averaged): the optimizer-in-backward steps that unit here and frees its gradient.
        self.on_unit_grads: Callable[[int], None] | None = None
        self.comm_log: list[CommCall] | None = None
        broadcast_module(module)
        self._units = self._build_units(module, list(units or []))
        self._order = list(self._units)  # forward order: registration order until one is recorded
        self._recorded: list[Unit] = []
        self._live: dict[int, tuple[Unit, int]] = {}  # storage ptr of a gathered weight -> (unit, k)
        self._rs_pending: list[tuple[Pending, Unit]] = []
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
    def _build_units(self, module: nn.Module, roots: list[nn.Module]) -> list[Unit]:
        units = []
        for index, (root, layers) in enumerate(fu.group_layers(module, roots)):
            entries, offset = [], 0
            for name, sub in layers:
                entries.append(self._shard(sub, name, offset))
                offset += entries[-1].shard.numel()
            units.append(Unit(index, root, entries, offset))
        return units

    def _shard(self, sub: nn.Module, name: str, offset: int) -> fu.Entry:
        """Cut ``sub``'s row shard (a hook: the 8B driver materializes each layer here first)."""
        return fu.cut_shard(sub, name, offset, self.rank, self.world_size)

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
        if not in_backward() and torch.is_grad_enabled():
            self._start_iteration()
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            out = self.module(*args, **kwargs)
        if not in_backward():
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
            unit.reset_grads()

    def _begin_unit(self, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append(("fwd_start", unit.index))
        if torch.autograd.profiler._is_profiler_enabled and unit.index not in self._fwd_ranges:
            # entered here, left in _end_unit: the range spans the unit's forward (overlap.unit_readiness)
            rf = torch.profiler.record_function(f"fsdp.forward[{unit.index}]")
            rf.__enter__()
            self._fwd_ranges[unit.index] = rf
        if in_backward():  # a checkpointed block re-running its forward
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

    def _next_units(self, unit: Unit) -> list[Unit]:
        pos = next((i for i, u in enumerate(self._order) if u is unit), None)
        return [] if pos is None else self._order[pos + 1 : pos + 1 + self.prefetch]

    def _swap_in(self, unit: Unit, k: int, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        entry = unit.entries[k]
        if unit.fwd is None:  # e.g. a checkpoint re-running a block's inner function, not the block
            self._begin_unit(unit)
        if torch.is_grad_enabled() and entry.shard.requires_grad and not in_backward():
            unit.expected[k] += 1
        entry.module._parameters["weight"] = _Gather.apply(entry.shard, self, unit, k)
        if self.compute_dtype is None:
            return None
        for n, q in entry.extras.items():  # e.g. the bias joins the layer's compute dtype
            if q.is_floating_point():
                entry.module._parameters[n] = q.to(self.compute_dtype)
        cast = lambda x: x.to(self.compute_dtype) if torch.is_tensor(x) and x.is_floating_point() else x
        return tuple(cast(a) for a in args), {n: cast(v) for n, v in kwargs.items()}

    def _swap_out(self, entry: fu.Entry) -> None:
        entry.module._parameters["weight"] = entry.shard
        entry.module._parameters.update(entry.extras)

    def _end_unit(self, unit: Unit) -> None:
        if self.trace is not None:
            self.trace.append(("fwd_end", unit.index))
        rf = self._fwd_ranges.pop(unit.index, None)
        if rf is not None:
            rf.__exit__(None, None, None)
        for t in unit.fwd or []:
            self._live.pop(t.untyped_storage().data_ptr(), None)
        unit.fwd = None
        if in_backward():  # the re-run forward's saved tensors hold what the backward needs
            unit.bwd = None

    # ---- communication ------------------------------------------------------------------------
    @torch.no_grad()
    def _launch_gather(self, unit: Unit, phase: str = "gather") -> Pending:
        if self.trace is not None:
            self.trace.append((phase, unit.index))
        with profiler_range(f"fsdp.{'allgather' if phase == 'gather' else 'bwd_allgather'}[{unit.index}]"):
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

    def _issue_gather(self, unit: Unit) -> Pending:
        send = fu.gather_send_buffer(unit, self.compute_dtype or unit.entries[0].shard.dtype)
        out = send.new_empty(unit.numel * self.world_size)
        self._log("all_gather", unit, send, out)
        return Pending(fu._all_gather(out, send, async_op=True), out, send)

    def _log(self, op: str, unit: Unit, send: torch.Tensor, out: torch.Tensor) -> None:
        """Record a collective in ``comm_log`` (and a reduce-scatter in ``trace``, which traces the
        gathers by phase where they are launched)."""
        if self.trace is not None and op == "reduce_scatter":
            self.trace.append((op, unit.index))
        if self.comm_log is not None:
            nbytes = send.element_size()
            self.comm_log.append(
                CommCall(op, unit.index, send.dtype, send.numel() * nbytes, out.numel() * nbytes)
            )

    @staticmethod
    def _wait_gather(pending: Pending) -> None:
        """The compute stream (or, without one, the host) waits until the gathered buffer is full."""
        if pending.done is None:
            pending.work.wait()
        else:
            torch.cuda.current_stream(pending.out.device).wait_event(pending.done)

    def _materialize(self, unit: Unit, pending: Pending) -> list[torch.Tensor]:
        """Wait for a gather and return each entry's full weight (trimmed of its padding rows)."""
        self._wait_gather(pending)
        fulls = fu.full_weights(unit, pending.out, self.world_size)
        copies = fulls if len(fulls) > 1 else []  # one entry: a view of the gathered buffer
        for t in [pending.out, *copies]:
            self._full_storages.append(weakref.ref(t.untyped_storage()))
        return fulls

    def _backward_bases(self, unit: Unit) -> list[torch.Tensor]:
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
            if self.trace is not None:  # the prefetches above are out before this unit computes
                self.trace.append(("bwd_ready", unit.index))
        return unit.bwd

    def _previous_needing_gather(self, unit: Unit, ahead: int) -> list[Unit]:
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
        return SavedWeight(unit, k, t.size(), t.stride(), t.storage_offset())

    def _unpack(self, saved: Any) -> torch.Tensor:
        if not isinstance(saved, SavedWeight):
            return saved
        base = self._backward_bases(saved.unit)[saved.k]
        if not saved.unit.trainable:  # no gradient will arrive to say it is no longer needed
            saved.unit.bwd = None
        return base.as_strided(saved.size, saved.stride, saved.offset)

    def _on_grad(self, unit: Unit, k: int, grad: torch.Tensor) -> None:
        unit.grads[k] = grad if unit.grads[k] is None else unit.grads[k] + grad
        unit.received[k] += 1
        if any(r < x for r, x in zip(unit.received, unit.expected, strict=True)):
            return
        unit.bwd = unit.fwd = None  # every use of the gathered weight has run its backward
        for e in unit.entries:  # a checkpoint re-run may stop early, before our post-forward hooks
            self._swap_out(e)
        self._launch_reduce_scatter(unit)

    @torch.no_grad()
    def _launch_reduce_scatter(self, unit: Unit) -> None:
        unit.launched = True
        send = fu.scatter_send_buffer(unit, self.reduce_dtype or unit.entries[0].shard.dtype, self.world_size)
        unit.grads = [None] * len(unit.entries)
        out = send.new_empty(unit.numel)
        self._log("reduce_scatter", unit, send, out)
        self._rs_pending.append((Pending(fu._reduce_scatter(out, send, async_op=True), out, send), unit))
        while len(self._rs_pending) > 2:  # bound the full-size gradients held by calls in flight
            self._finish_reduce_scatter(*self._rs_pending.pop(0))

    @torch.no_grad()
    def _finish_reduce_scatter(self, pending: Pending, unit: Unit) -> None:
        pending.work.wait()
        fu.add_shard_grads(unit, pending.out.div_(self.world_size))
        if self.on_unit_grads is not None:
            self.on_unit_grads(unit.index)

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
            unit.reset_grads()
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
                fu._all_gather(out, t.contiguous())
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

    def unit_shards(self) -> list[list[nn.Parameter]]:
        """Each unit's trainable shards, by unit index (what ``on_unit_grads`` announces)."""
        return [[e.shard for e in u.entries if e.shard.requires_grad] for u in self._units]

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The trainable replicated parameters: final once ``finish_gradient_synchronization`` has
        all-reduced them."""
        return list(self._replicated)
