"""Small models and the check every data-parallel wrapper must pass: trained on random data, its
weights equal those of one process trained on the whole batch (handout naive_ddp).

The models cover the awkward cases: a frozen layer (``requires_grad=False``), a buffer, a tied
weight (the embedding is the output head), and a layer ``extra`` that only the samples flagged in a
mask pass through: every rank uses it ("all"), no rank does ("none": no gradient anywhere), or
only rank 0's samples do ("rank0": no gradient on the other ranks). Float64 throughout, so any
mismatch is a bug and not rounding.

Models and batches live on the rank's device (CPU under gloo, its GPU under nccl). Runnable as the
handout's script (starts the ranks itself; gloo on CPU, nccl when every rank has a GPU):

    python -m tests.helpers.toy --nproc 2 --variant naive
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from cs336_systems.distributed.comm import rank_device, require_process_group, shard_batch, world
from cs336_systems.distributed.ddp import DataParallel
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_factory import VARIANTS, make_ddp

# The models are grading's beyond-tier ones (one copy, shared by its judge and workers; it imports only torch).
from cs336_systems.grading.shared.models import DTYPE, IN, OUT, VOCAB, TiedToyModel, ToyModel

MODELS: dict[str, type[nn.Module]] = {"toy": ToyModel, "tied": TiedToyModel}


def make_model(name: str, seed: int) -> nn.Module:
    """Initialized on the CPU from ``seed`` (the same values on any device), then moved to this
    rank's device (its GPU under nccl)."""
    torch.manual_seed(seed)
    return MODELS[name]().to(device=rank_device(), dtype=DTYPE)


def make_batch(name: str, step: int, global_batch: int, extra: str) -> tuple[torch.Tensor, ...]:
    """The global batch of a step, the same on every rank: inputs, targets, and the per-sample
    flag of who passes through ``extra``."""
    gen = torch.Generator().manual_seed(1000 + step)
    if name == "toy":
        x = torch.randn(global_batch, IN, generator=gen, dtype=DTYPE)
        y = torch.randn(global_batch, OUT, generator=gen, dtype=DTYPE)
    else:
        x = torch.randint(VOCAB, (global_batch, 6), generator=gen)
        y = torch.randint(VOCAB, (global_batch, 6), generator=gen)
    _, world_size = world()
    mask = torch.zeros(global_batch, dtype=torch.bool)
    if extra == "all":
        mask[:] = True
    elif extra == "rank0":
        mask[: global_batch // world_size] = True
    device = rank_device()
    return x.to(device), y.to(device), mask.to(device)


def loss_fn(name: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if name == "toy":
        return F.mse_loss(out, y)
    return F.cross_entropy(out.reshape(-1, VOCAB), y.reshape(-1))


def make_optimizer(name: str, params) -> torch.optim.Optimizer:
    if name == "sgd":
        return torch.optim.SGD(params, lr=0.1, momentum=0.9, weight_decay=0.01)
    return torch.optim.AdamW(params, lr=0.05, weight_decay=0.1)


def wrap(variant: str, module: nn.Module, bucket_mb: float | None = None) -> DataParallel:
    return make_ddp(variant, module, bucket_mb)


def default_after_backward(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp.finish_gradient_synchronization()


def default_batch_start(ddp: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    ddp.on_train_batch_start()


@dataclass(frozen=True)
class EquivalenceCase:
    model: str = "toy"
    variant: str = "naive"
    bucket_mb: float | None = None
    optimizer: str = "sgd"
    set_to_none: bool = True
    extra: str = "all"  # who uses the `extra` layer: all / none / rank0
    steps: int = 4
    per_rank_batch: int = 2


def compare_with_single_process(
    case: EquivalenceCase,
    wrap_fn: Callable[[nn.Module], nn.Module] | None = None,
    after_backward: Callable = default_after_backward,
    batch_start: Callable = default_batch_start,
) -> dict:
    """Rank function body: train ``case`` data-parallel and, in the same process, a reference
    model on the whole batch; return how far apart they are. Ranks start from different weights
    (rank 0's are the reference's), so the wrapper's broadcast is checked too."""
    require_process_group("compare_with_single_process")
    rank, world_size = world()
    reference = make_model(case.model, seed=0)
    local = make_model(case.model, seed=0 if rank == 0 else 100 + rank)
    ddp = wrap_fn(local) if wrap_fn is not None else wrap(case.variant, local, case.bucket_mb)
    init_diff = max_diff(ddp.module, reference)
    opt_ref = make_optimizer(case.optimizer, reference.parameters())
    opt = make_optimizer(case.optimizer, ddp.parameters())
    global_batch = case.per_rank_batch * world_size
    for step in range(case.steps):
        x, y, mask = make_batch(case.model, step, global_batch, case.extra)
        opt_ref.zero_grad(set_to_none=case.set_to_none)
        loss_fn(case.model, reference(x, mask), y).backward()
        opt_ref.step()
        opt.zero_grad(set_to_none=case.set_to_none)
        batch_start(ddp, opt)
        xs, ys, ms = (shard_batch(t, rank, world_size) for t in (x, y, mask))
        loss_fn(case.model, ddp(xs, ms), ys).backward()
        after_backward(ddp, opt)
        opt.step()
    grads_none = [p.grad is None for p in ddp.module.parameters()]
    return {
        "init_diff": init_diff,
        "diff": max_diff(ddp.module, reference),
        "grads_none_match": grads_none == [p.grad is None for p in reference.parameters()],
        "params": torch.cat([p.detach().reshape(-1) for p in ddp.module.parameters()]).cpu(),
        "num_buckets": len(ddp.buckets) if isinstance(ddp, DDPBucketed) else None,
    }


@torch.no_grad()
def max_diff(a: nn.Module, b: nn.Module) -> float:
    pairs = [*zip(a.parameters(), b.parameters(), strict=True), *zip(a.buffers(), b.buffers(), strict=True)]
    return max((x - y).abs().max().item() for x, y in pairs)


def run_equivalence(cases: list[EquivalenceCase]) -> list[dict]:
    """Rank function: every case in turn (on fresh models)."""
    return [compare_with_single_process(case) for case in cases]


def main() -> None:
    from cs336_systems.distributed.launch import spawn

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--variant", choices=VARIANTS, default="naive")
    parser.add_argument("--bucket-mb", type=float, default=0.001)
    parser.add_argument("--model", choices=tuple(MODELS), default="toy")
    parser.add_argument("--optimizer", choices=("sgd", "adamw"), default="sgd")
    args = parser.parse_args()
    case = EquivalenceCase(
        model=args.model,
        variant=args.variant,
        bucket_mb=args.bucket_mb if args.variant == "bucketed" else None,
        optimizer=args.optimizer,
    )
    results = spawn(run_equivalence, args.nproc, [case])
    for rank, (result,) in enumerate(results):
        print(f"rank {rank}: max |ddp - single process| = {result['diff']:.3g} after {case.steps} steps")
    same = all(torch.equal(r[0]["params"], results[0][0]["params"]) for r in results)
    print("all ranks hold identical weights" if same else "RANKS DIFFER")
    if not same or max(r[0]["diff"] for r in results) > 1e-10:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
