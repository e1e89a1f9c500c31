"""D16/D17: the overlapping DDP wrappers communicate *during* backward, and buckets are sized in MiB.

The equivalence tests (test_ddp.py) cannot see when gradients are communicated: a wrapper that sends
nothing during backward and all-reduces everything in ``finish_gradient_synchronization`` trains to
the same weights. Here each rank logs, in order, every gradient accumulation (a hook registered on
each parameter before the wrapper adds its own, so it fires first) and every
``torch.distributed.all_reduce`` call (the function replaced by a logging wrapper for the step), with
markers for where backward and ``finish_gradient_synchronization`` start. The log must show:

- individual: each gradient's async all-reduce issued right after that gradient is accumulated,
  nothing left for ``finish``;
- bucketed: each bucket's async all-reduce issued as soon as it and every earlier bucket are complete
  (buckets go out in index order), several while backward still has gradients to compute.

CPU, gloo, 2 ranks, one spawn for every case.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from cs336_systems.distributed.ddp_bucketed import assign_buckets

from . import adapters
from .helpers.toy import DTYPE, IN, make_model

Event = tuple  # ("grad", name) | ("all_reduce", numel, async_op) | ("backward",) | ("finish",)


@contextmanager
def logged_all_reduce(events: list[Event]) -> Iterator[None]:
    """Log every ``dist.all_reduce`` call (looked up on the module at call time, as the wrappers do)."""
    original = dist.all_reduce

    def all_reduce(tensor, *args, **kwargs):
        async_op = kwargs.get("async_op", args[2] if len(args) > 2 else False)
        events.append(("all_reduce", tensor.numel(), bool(async_op)))
        return original(tensor, *args, **kwargs)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original


def _one_step_log(variant: str, bucket_mb: float | None) -> dict:
    model = make_model("toy", seed=0)
    events: list[Event] = []
    numel = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            numel[name] = p.numel()
            # registered before the wrapper's hooks: logs the gradient before the wrapper reacts to it
            p.register_post_accumulate_grad_hook(lambda p, name=name: events.append(("grad", name)))
    if variant == "individual":
        ddp = adapters.get_ddp_individual_parameters(model)
        after_backward = adapters.ddp_individual_parameters_on_after_backward
    else:
        ddp = adapters.get_ddp_bucketed(model, bucket_size_mb=bucket_mb)
        after_backward = adapters.ddp_bucketed_on_after_backward
        adapters.ddp_bucketed_on_train_batch_start(ddp, None)
    x = torch.randn(4, IN, dtype=DTYPE, generator=torch.Generator().manual_seed(dist.get_rank()))
    use_extra = torch.ones(4, dtype=torch.bool)  # every parameter gets a gradient
    with logged_all_reduce(events):
        loss = ddp(x, use_extra).sum()
        events.append(("backward",))
        loss.backward()
        events.append(("finish",))
        after_backward(ddp, None)
    buckets = ddp.bucket_names if variant == "bucketed" else None
    return {"events": events, "numel": numel, "buckets": buckets}


CASES = [("individual", None), ("bucketed", 0.0001), ("bucketed", 0.001)]


def _logs() -> list[dict]:
    return [_one_step_log(variant, bucket_mb) for variant, bucket_mb in CASES]


def _phases(events: list[Event]) -> tuple[list[Event], list[Event]]:
    """(events during backward, events from finish_gradient_synchronization on)."""
    backward, finish = events.index(("backward",)), events.index(("finish",))
    return events[backward + 1 : finish], events[finish + 1 :]


def _expected_bucketed(during: list[Event], buckets: list[list[str]]) -> list[str]:
    """The kinds of events during backward when each bucket goes out as soon as it and all earlier
    buckets are complete."""
    expected, seen, next_bucket = [], set(), 0
    for event in during:
        if event[0] != "grad":
            continue
        expected.append("grad")
        seen.add(event[1])
        while next_bucket < len(buckets) and set(buckets[next_bucket]) <= seen:
            expected.append("all_reduce")
            next_bucket += 1
    return expected


def check_individual(log: dict) -> None:
    during, finish = _phases(log["events"])
    assert len([e for e in during if e[0] == "grad"]) == len(log["numel"]) == 8
    # grad p, its async all-reduce, grad q, its async all-reduce, ...
    for grad, launch in itertools.zip_longest(during[0::2], during[1::2]):
        assert grad[0] == "grad", f"individual: expected a gradient, got {grad}: {during}"
        assert launch == ("all_reduce", log["numel"][grad[1]], True), (
            f"individual: the gradient of {grad[1]} was not all-reduced asynchronously right away: {during}"
        )
    assert not [e for e in finish if e[0] == "all_reduce"], (
        f"individual: all-reduces left for finish: {finish}"
    )


def check_bucketed(log: dict, bucket_mb: float) -> None:
    during, finish = _phases(log["events"])
    buckets = log["buckets"]
    assert len(buckets) > 1, f"bucketed {bucket_mb}: one bucket, nothing to overlap"
    assert [e[0] for e in during] == _expected_bucketed(during, buckets), (
        f"bucketed {bucket_mb}: buckets {buckets} not launched as soon as complete: {during}"
    )
    launches = [e for e in during if e[0] == "all_reduce"]
    assert len(launches) == len(buckets) and all(async_op for _, _, async_op in launches), during
    last_grad = max(i for i, e in enumerate(during) if e[0] == "grad")
    assert during.index(launches[0]) < last_grad, f"bucketed {bucket_mb}: no launch before backward ends"
    assert not [e for e in finish if e[0] == "all_reduce"], f"bucketed {bucket_mb}: left for finish: {finish}"


@pytest.mark.distributed
@pytest.mark.timeout(120)
def test_overlapping_wrappers_all_reduce_during_backward(run_distributed) -> None:
    for rank_logs in run_distributed(_logs, 2, backend="gloo", timeout=60):
        for (variant, bucket_mb), log in zip(CASES, rank_logs, strict=True):
            if variant == "individual":
                check_individual(log)
            else:
                check_bucketed(log, bucket_mb)


def test_bucket_cap_is_in_mib_not_mb() -> None:
    """A 2 MiB cap (2,097,152 bytes) holds two fp32 tensors of 1 MiB each; 2 MB (2,000,000) would not."""
    mib = 2**18  # fp32 elements in 1 MiB

    def layout(*sizes: int, cap_mb: float) -> list[list[int]]:
        params = [torch.nn.Parameter(torch.empty(n)) for n in sizes]
        return [[p.numel() for p in b.params] for b in assign_buckets(params, cap_mb)]

    assert layout(mib, mib, cap_mb=2) == [[mib, mib]]  # exactly full
    assert layout(mib, mib + 1, cap_mb=2) == [[mib + 1], [mib]]  # 4 bytes over
    assert layout(mib // 2, mib // 2, cap_mb=1) == [[mib // 2, mib // 2]]
    assert layout(mib // 2, mib // 2, 10, cap_mb=1) == [[10, mib // 2], [mib // 2]]
