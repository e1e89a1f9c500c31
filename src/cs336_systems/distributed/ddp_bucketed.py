"""D17: data parallelism with bucketed, overlapped gradient all-reduce.

Parameters are packed into buckets of at most ``bucket_size_mb`` MiB (MiB as torch DDP's
``bucket_cap_mb``), in reverse ``parameters()`` order because backward produces gradients roughly
in that order; a parameter larger than the cap gets a bucket of its own, and a bucket never mixes
devices or dtypes (it is one flat buffer). When the last gradient of a bucket is accumulated, a
post-accumulate-grad hook flattens the bucket's gradients into a new buffer and launches an async
all-reduce; ``finish_gradient_synchronization()`` waits, divides by the world size and copies the
averages back into ``.grad``.

Buckets are launched strictly in index order (a complete bucket waits for the earlier ones): NCCL
pairs collectives across ranks by call order, so every rank must issue the same sequence even when
gradients arrive in a different order, or when some parameter gets no gradient at all.

Parameters without a gradient in a step never hang the step: at ``finish`` the incomplete buckets
are launched with zeros in place of the missing gradients. Each bucket also carries one "used" flag
per parameter (a few extra elements), all-reduced with the gradients, so a parameter that got no
gradient on any rank keeps ``grad=None`` (the optimizer skips it, as in single-process training),
while one used on some ranks only gets the average over all ranks everywhere.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from cs336_systems.distributed.comm import trainable_parameters
from cs336_systems.distributed.ddp import DataParallel
from cs336_systems.units import mb_to_bytes


@dataclass
class Bucket:
    params: list[nn.Parameter]
    offsets: list[int] = field(default_factory=list)
    numel: int = 0
    # per-step state
    ready: int = 0
    buffer: torch.Tensor | None = None
    work: dist.Work | None = None
    missing: list[bool] = field(default_factory=list)
    ones: torch.Tensor = field(init=False)  # the "used" flags when every gradient is present

    def __post_init__(self) -> None:
        for p in self.params:
            self.offsets.append(self.numel)
            self.numel += p.numel()
        ref = self.params[0]
        self.ones = torch.ones(len(self.params), device=ref.device, dtype=ref.dtype)

    @property
    def complete(self) -> bool:
        return self.ready == len(self.params)

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def reset(self) -> None:
        self.ready, self.buffer, self.work, self.missing = 0, None, None, []


def assign_buckets(params: list[nn.Parameter], bucket_size_mb: float) -> list[Bucket]:
    """Greedy packing in reverse order; a new bucket starts when the cap would be exceeded or the
    device/dtype changes."""
    if not bucket_size_mb > 0:
        raise ValueError(f"bucket_size_mb must be positive, got {bucket_size_mb}")
    cap = mb_to_bytes(bucket_size_mb)
    buckets: list[list[nn.Parameter]] = []
    size = 0.0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        current = buckets[-1] if buckets else None
        if (
            current is None
            or size + nbytes > cap
            or (current[0].device, current[0].dtype) != (p.device, p.dtype)
        ):
            buckets.append([p])
            size = nbytes
        else:
            current.append(p)
            size += nbytes
    return [Bucket(b) for b in buckets]


class DDPBucketed(DataParallel):
    """``DDPBucketed(module, bucket_size_mb)``; ``.module`` is the wrapped model, ``forward`` delegates.

    Per step: ``on_train_batch_start()`` (optional; resets per-step state), forward, backward,
    ``finish_gradient_synchronization()``, optimizer step. Works with ``zero_grad`` in either style.
    """

    def __init__(self, module: nn.Module, bucket_size_mb: float):
        super().__init__(module)
        self.bucket_size_mb = bucket_size_mb
        params = trainable_parameters(module)
        self.buckets = assign_buckets(params, bucket_size_mb)
        self._where = {
            id(p): (b, i) for b, bucket in enumerate(self.buckets) for i, p in enumerate(bucket.params)
        }
        self._next = 0  # index of the next bucket to launch
        self._hook_gradients(params)

    @property
    def bucket_names(self) -> list[list[str]]:
        return [[self._names[id(p)] for p in b.params] for b in self.buckets]

    def on_train_batch_start(self) -> None:
        """Reset per-step state. Collectives still in flight from an unfinished step are waited for
        (and their results dropped) so none is left dangling."""
        if self._next:
            warnings.warn(
                "on_train_batch_start: the previous step launched all-reduces but never called "
                "finish_gradient_synchronization(); its gradients were not averaged",
                RuntimeWarning,
                stacklevel=2,
            )
            for bucket in self.buckets[: self._next]:
                bucket.work.wait()
        self._reset()

    def _reset(self) -> None:
        for bucket in self.buckets:
            bucket.reset()
        self._seen.clear()
        self._next = 0

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        b, _ = self._where[id(param)]
        self.buckets[b].ready += 1
        while self._next < len(self.buckets) and self.buckets[self._next].complete:
            self._launch(self._next)

    @torch.no_grad()
    def _launch(self, b: int) -> None:
        bucket = self.buckets[b]
        if b != self._next:
            raise AssertionError(f"bucket {b} launched out of order (next is {self._next})")
        ref = bucket.params[0]
        grads = [p.grad for p in bucket.params]
        bucket.missing = [g is None for g in grads]
        pieces = [
            torch.zeros(p.numel(), device=ref.device, dtype=ref.dtype) if g is None else g.reshape(-1)
            for p, g in zip(bucket.params, grads, strict=True)
        ]
        # The flags are built on the device: a host-to-device copy from pageable memory would wait
        # for the stream to drain and so stall the backward pass this is meant to overlap.
        used = bucket.ones
        if any(bucket.missing):
            used = used.clone()
            for i in (i for i, m in enumerate(bucket.missing) if m):
                used[i] = 0
        pieces.append(used)
        bucket.buffer = torch.cat(pieces)
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)
        self._next += 1

    @torch.no_grad()
    def finish_gradient_synchronization(self) -> None:
        """Launch what backward did not (buckets with missing gradients), wait for every bucket,
        average, and write the results into ``.grad``."""
        while self._next < len(self.buckets):
            self._launch(self._next)
        for bucket in self.buckets:
            bucket.work.wait()
            buffer = bucket.buffer.div_(self.world_size)
            views = [
                buffer[o : o + p.numel()].view_as(p)
                for o, p in zip(bucket.offsets, bucket.params, strict=True)
            ]
            present = [i for i, m in enumerate(bucket.missing) if not m]
            if present:
                torch._foreach_copy_([bucket.params[i].grad for i in present], [views[i] for i in present])
            if len(present) < len(bucket.params):
                self._fill_missing(bucket, views)
        self._reset()

    def _fill_missing(self, bucket: Bucket, views: list[torch.Tensor]) -> None:
        # Rare path (a parameter without a local gradient): reading the flags syncs with the device.
        used = bucket.buffer[bucket.numel :].tolist()
        for i, p in enumerate(bucket.params):
            if bucket.missing[i] and used[i] > 0:
                p.grad = views[i].clone()
