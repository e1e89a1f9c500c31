"""The data-parallel training step every DDP / sharding bench and ``cli/ddp_train.py`` runs (a
harness: it spawns nothing itself, but it is the measured run of those benches).

``run_cases(setup, cases)`` is a rank function (call it under ``launch.spawn`` or torchrun): for each
case it builds the model preset on the rank's device, wraps it in the case's DDP variant, builds
the case's optimizer, shards one fixed global batch (the world size must divide it), runs warm-up
and timed steps, optionally a profiled step, and returns this rank's numbers. Cases run one after
another in the same process group, freeing the device between them, so one spawn covers a table.

Memory (CUDA only): allocated and peak right after building the model, its DDP wrapper and its
optimizer (``*_after_init_mib``), then in one steady-state step after the warm-up (optimizer state
present), peak within the step up to right before / right after ``optimizer.step()``.

Per timed step (all on the device timeline, read after the step's final synchronize):
- ``step_ms``: host clock from the step's start to the synchronize after ``optimizer.step()``.
- ``fwd_bwd_ms`` / ``comm_ms`` / ``optim_ms``: split by markers (CUDA events, host clock on CPU)
  after ``backward()`` and after ``finish_gradient_synchronization()``. ``comm_ms`` is the time the
  step spends waiting for gradient communication after backward: all of it for naive / flat, the
  part not hidden behind backward for the overlapping wrappers; torch DDP waits inside backward,
  so its figure is None and its overhead shows against the ``local`` case (same step, no
  communication).

Variants: local (no communication), naive, flat, individual, bucketed, torch_ddp, fsdp / fsdp_blocks
(ours per Linear / per Transformer block), torch_fsdp2 / torch_fsdp2_blocks (fully_shard alike);
optimizers: adamw (torch.optim.AdamW), sharded (our ShardedOptimizer over AdamW), zero (torch's
ZeroRedundancyOptimizer over AdamW). Another implementation's DDP and sharded optimizer (the benches'
``adapters`` rows) never run here: they run in grading workers of their own code
(``cs336_systems.grading.worker.timing``).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from cs336_systems.distributed.comm import (
    barrier,
    rank_device,
    require_process_group,
    shard_batch,
    share_cpu_threads,
    world,
)
from cs336_systems.distributed.ddp import DataParallel
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_factory import make_ddp
from cs336_systems.distributed.overlap import profile_overlap
from cs336_systems.distributed.sharded_optimizer import ShardedOptimizer
from cs336_systems.grading.shared.training import held_optimizers
from cs336_systems.model import TransformerLM, cross_entropy, get_preset
from cs336_systems.profiling.marks import StepMarks
from cs336_systems.profiling.memory import free_device_memory
from cs336_systems.profiling.timing import is_oom, synchronize
from cs336_systems.training.loop import train_step
from cs336_systems.units import MIB

SHARDED = ("fsdp", "torch_fsdp2", "fsdp_blocks", "torch_fsdp2_blocks")  # bf16: cast weights, not autocast
VARIANTS = ("local", "naive", "flat", "individual", "bucketed", "torch_ddp", *SHARDED)
NO_SYNC_STEP = ("local", "torch_ddp", "torch_fsdp2", "torch_fsdp2_blocks")  # nothing to finish after backward
BUCKETED = ("bucketed", "torch_ddp")
OPTIMIZERS = ("adamw", "sharded", "zero")


@dataclass(frozen=True)
class TrainSetup:
    preset: str = "tiny"
    context_length: int = 32
    global_batch: int = 4
    dtype: str = "fp32"  # "bf16": fp32 parameters, forward/backward under bf16 autocast
    warmup: int = 2
    steps: int = 5
    profile_steps: int = 0  # >0: one profiled run of this many steps for the overlap share
    trace_dir: str | None = None  # keep rank 0's Chrome traces here...
    trace_variants: tuple[str, ...] | None = None  # ...of these variants only (None: all)
    lr: float = 1e-4
    seed: int = 0

    @property
    def label(self) -> str:
        return f"{self.preset}-ctx{self.context_length}-{self.dtype}"


@dataclass(frozen=True)
class TrainCase:
    variant: str = "bucketed"
    bucket_mb: float | None = None
    optimizer: str = "adamw"

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown DDP variant {self.variant!r}; choose one of {VARIANTS}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.optimizer!r}; choose one of {OPTIMIZERS}")
        if (self.variant in BUCKETED) != (self.bucket_mb is not None):
            raise ValueError(
                f"variant {self.variant!r}: bucket_mb is required for {BUCKETED} and only for them"
            )

    @property
    def key(self) -> str:
        parts = [self.variant]
        if self.bucket_mb is not None:
            parts.append(f"{self.bucket_mb:g}MB")
        if self.optimizer != "adamw":
            parts.append(self.optimizer)
        return "-".join(parts)


# -- building blocks -----------------------------------------------------------------------------


def wrap_model(
    model: nn.Module, case: TrainCase, device: torch.device, compute_dtype: torch.dtype | None = None
) -> nn.Module:
    if case.variant == "local":
        return model
    if case.variant in ("fsdp", "fsdp_blocks"):
        from cs336_systems.distributed.fsdp import FSDP

        units = list(model.layers) if case.variant == "fsdp_blocks" else None
        return FSDP(model, compute_dtype=compute_dtype, units=units)
    if case.variant in ("torch_fsdp2", "torch_fsdp2_blocks"):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Same setting as ours: one unit per Linear/Embedding (or per Transformer block, plus the
        # embedding and the LM head), weights cast to the compute dtype before the all-gather,
        # gradients reduced in fp32.
        mp = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
        if case.variant == "torch_fsdp2_blocks":
            subs = [*model.layers, model.token_embeddings, model.lm_head]
        else:
            subs = [m for m in model.modules() if isinstance(m, nn.Linear | nn.Embedding)]
        for sub in subs:
            fully_shard(sub, mp_policy=mp)
        return fully_shard(model, mp_policy=mp)
    if case.variant != "torch_ddp":
        return make_ddp(case.variant, model, case.bucket_mb)
    device_ids = [device.index] if device.type == "cuda" else None
    # broadcast_buffers=False: like our wrappers, buffers (the RoPE tables) are synced once at
    # construction, not before every forward; everything else is torch's default configuration.
    return nn.parallel.DistributedDataParallel(
        model, device_ids=device_ids, bucket_cap_mb=case.bucket_mb, broadcast_buffers=False
    )


def make_optimizer(params: Any, name: str, lr: float) -> torch.optim.Optimizer:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "sharded":
        return ShardedOptimizer(params, torch.optim.AdamW, lr=lr)
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, lr=lr)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimizer state this rank holds (the wrapped optimizer's, for the sharded ones; for
    another implementation, that of every optimizer it holds, each tensor counted once)."""
    inner = getattr(optimizer, "local_optimizer", None) or getattr(optimizer, "optim", None)
    holders = [inner] if inner is not None else held_optimizers(optimizer)
    tensors = {
        id(t): t
        for holder in holders
        for state in holder.state.values()
        for t in state.values()
        if isinstance(t, torch.Tensor)
    }
    return sum(local_bytes(t) for t in tensors.values())


def local_bytes(t: torch.Tensor) -> int:
    """Bytes this rank holds of ``t`` (a DTensor's local shard, not its global size)."""
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def memory_mib(device: torch.device) -> tuple[float | None, float | None]:
    """(allocated now, peak allocated since the last reset) in MiB; None on CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.memory_allocated(device) / MIB, torch.cuda.max_memory_allocated(device) / MIB


# -- one case ------------------------------------------------------------------------------------


def _batch(setup: TrainSetup, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    rank, world_size = world()
    gen = torch.Generator().manual_seed(setup.seed)
    tokens = torch.randint(vocab, (setup.global_batch, setup.context_length + 1), generator=gen)
    local = shard_batch(tokens, rank, world_size).to(device)
    return local[:, :-1], local[:, 1:]


def run_ddp_case(setup: TrainSetup, case: TrainCase, device: torch.device) -> dict[str, Any]:
    rank, world_size = world()
    free_device_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    config = get_preset(setup.preset)
    if setup.context_length > config.context_length:
        config = config.with_(context_length=setup.context_length)
    torch.manual_seed(setup.seed)
    x, y = _batch(setup, config.vocab_size, device)
    model = TransformerLM(config, device=device, dtype=torch.float32)
    sharded = case.variant in SHARDED
    compute_dtype = torch.bfloat16 if setup.dtype == "bf16" and sharded else None
    ddp = wrap_model(model, case, device, compute_dtype)
    optimizer = make_optimizer(ddp.parameters(), case.optimizer, setup.lr)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16)
        if setup.dtype == "bf16" and not sharded
        else contextlib.nullcontext()
    )
    params = list(model.parameters())
    out: dict[str, Any] = {
        "params_mib": sum(local_bytes(p) for p in params) / MIB,  # this rank's (shards when sharded)
        "grads_mib": sum(local_bytes(p) for p in params if p.requires_grad) / MIB,
        "num_params": sum(p.numel() for p in params),
        "num_tensors": len(params),
        "per_rank_batch": x.shape[0],
    }
    if isinstance(ddp, DDPBucketed):
        out["num_buckets"] = len(ddp.buckets)
    out["mem_after_init_mib"], out["peak_after_init_mib"] = memory_mib(device)
    marks = StepMarks(device)

    def loss() -> torch.Tensor:
        if isinstance(ddp, DataParallel):
            ddp.on_train_batch_start()
        with autocast:  # forward and loss only: backward runs outside autocast, as torch recommends
            return cross_entropy(ddp(x), y)

    def step(record_memory: bool = False) -> None:
        def mark(name: str) -> None:
            marks.mark(name)
            if record_memory and name == "synced":  # right before optimizer.step()
                out["mem_before_step_mib"], out["peak_before_step_mib"] = memory_mib(device)
            elif record_memory and name == "end":  # right after it
                out["mem_after_step_mib"], out["peak_after_step_mib"] = memory_mib(device)

        train_step(ddp, optimizer, loss, mark, zero_grad_first=True)

    for _ in range(max(setup.warmup, 1)):  # the first step also creates the optimizer state
        step()
        synchronize(device)
    # One more untimed step, in the steady state, for the memory at the handout's points: peaks
    # within this step up to right before and right after optimizer.step().
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    step(record_memory=True)
    synchronize(device)
    barrier(device)
    step_ms, fwd_bwd, comm, optim = [], [], [], []
    for _ in range(setup.steps):
        t0 = time.perf_counter()
        step()
        synchronize(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        fwd_bwd.append(marks.ms("start", "backward"))
        comm.append(marks.ms("backward", "synced"))
        optim.append(marks.ms("synced", "end"))
    out.update(
        step_ms=step_ms,
        fwd_bwd_ms=statistics.fmean(fwd_bwd),
        comm_ms=statistics.fmean(comm) if case.variant not in NO_SYNC_STEP else None,
        optim_ms=statistics.fmean(optim),
        optim_state_mib=optimizer_state_bytes(optimizer) / MIB,
        peak_memory_mib=memory_mib(device)[1],
    )
    if setup.profile_steps > 0:
        trace = None
        keep = setup.trace_variants is None or case.variant in setup.trace_variants
        if setup.trace_dir is not None and rank == 0 and keep:
            trace = Path(setup.trace_dir) / f"{setup.label}-ws{world_size}-{case.key}.json.gz"
            out["trace"] = str(trace)
        out.update(profile_overlap(step, device, setup.profile_steps, trace))
    if isinstance(ddp, DataParallel):
        ddp.remove_hooks()
    return out


def run_cases(setup: TrainSetup, cases: list[TrainCase]) -> dict[str, dict[str, Any]]:
    """Rank function: every case in turn; a case that runs out of device memory becomes
    ``{"oom": True}`` (every rank runs the same shapes, so all ranks hit it at the same point)."""
    require_process_group("run_cases")
    share_cpu_threads()
    device = rank_device()
    results = {}
    for case in cases:
        try:
            results[case.key] = run_ddp_case(setup, case, device) | {"oom": False}
        except Exception as exc:  # torch raises OOM as several exception types
            if not is_oom(exc):
                raise
            results[case.key] = {"oom": True, "error": str(exc).splitlines()[0]}
        free_device_memory(device)
        barrier(device)
    return results


# -- across ranks --------------------------------------------------------------------------------


def combine_ranks(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """One case's numbers over ranks: a step ends when its slowest rank does, so the step times are
    the per-step max over ranks (``times_ms``, and ``mean_ms``/``std_ms``/``median_ms`` of them);
    every other figure is the max over ranks, except the overlap share (mean over ranks) and the
    all-gather ready share (min over ranks)."""
    if any(r.get("oom") for r in per_rank):
        return {"oom": True, "error": next(r.get("error") for r in per_rank if r.get("oom"))}
    times = [max(ts) for ts in zip(*(r["step_ms"] for r in per_rank), strict=True)]
    out: dict[str, Any] = {
        "times_ms": times,
        "mean_ms": statistics.fmean(times),
        "std_ms": statistics.stdev(times) if len(times) > 1 else 0.0,
        "median_ms": statistics.median(times),
        "max_ms": max(times),
        "oom": False,
    }
    first = per_rank[0]
    for key, value in first.items():
        if key in out or key == "step_ms":
            continue
        values = [r.get(key) for r in per_rank]
        if key == "overlap_share":
            present = [v for v in values if v is not None]
            out[key] = statistics.fmean(present) if present else None
        elif key == "allgather_ready_share":  # the worst rank's: a late gather stalls every rank
            out[key] = None if None in values else min(values)
        elif isinstance(value, int | float) and not isinstance(value, bool) and None not in values:
            out[key] = max(values)
        else:
            out[key] = value
    if out.get("comm_ms") is not None:
        out["comm_share"] = out["comm_ms"] / out["mean_ms"]
    return out
