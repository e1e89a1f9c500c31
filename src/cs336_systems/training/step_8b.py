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

Modules: ``options.py`` (:class:`StepOptions`, the recipes and ablations, the checkpoint policy, the
FLOPs), ``step_model.py`` (the model, whose LM head computes the loss), ``sharding.py`` (materialization,
sharding, the optimizer) and this one (the step, :func:`run_step`, the profiled step). The names callers
use are importable from here.

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
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.nn as nn

from cs336_systems.distributed.comm import barrier, rank_device, shard_batch, share_cpu_threads, world
from cs336_systems.profiling.flops import measure_matmul_tflops
from cs336_systems.profiling.marks import StepMarks
from cs336_systems.profiling.timing import synchronize
from cs336_systems.training.clipping import clip_grad_norm_
from cs336_systems.training.course_timing import course_do_bench
from cs336_systems.training.loop import train_step
from cs336_systems.training.options import (  # noqa: F401  (re-exported: callers import them from here)
    ABLATIONS,
    DTYPES,
    FSDP_CHOICES,
    KEEP_BUDGET_CPU_GIB,
    KEEP_BUDGET_SHARE,
    LOSS_CHOICES,
    OPTIMIZER_CHOICES,
    RECIPES,
    STEP_CHECKPOINT_GRAMMAR,
    StepOptions,
    keep_budget_bytes,
    model_flops_per_step,
    optimizer_in_backward_plan,
    predicted_step_memory,
    recipe,
    step_checkpoint_policy,
    validate_step_checkpoint,
)
from cs336_systems.training.sharding import build_optimizer, shard_model
from cs336_systems.training.step_model import (  # noqa: F401  (re-exported)
    LossHead,
    StepModel,
    build_meta_model,
    chunked_linear_cross_entropy,
    save_attention_context,
)
from cs336_systems.units import GIB, MIB

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


# A phase's time runs from one mark of ``train_step`` to another.
PHASES = {
    "forward_ms": ("start", "forward"),
    "backward_ms": ("forward", "synced"),  # backward and the wait for the last gradient reduction
    "optimizer_ms": ("synced", "end"),
}


def step_once(model: nn.Module, optimizer: Any, tokens: torch.Tensor, targets: torch.Tensor,
              mark: Callable[[str], None] = lambda name: None,
              grad_clip: float | None = None) -> torch.Tensor:  # fmt: skip
    """One step of the 8B model (whose forward returns the loss); ``grad_clip``: clip the global
    gradient norm before the (plain) optimizer step."""
    clip = None if grad_clip is None else (lambda: clip_grad_norm_(model, grad_clip))
    return train_step(model, optimizer, lambda: model(tokens, targets), mark, before_step=clip)


def _is_empty_cache(path: str | None) -> bool:
    """A cache directory given and empty (or not there yet): this run starts from cold caches. Without
    one the machine's default caches are used, which may be warm."""
    if not path:
        return False
    if not os.path.isdir(path):
        return True
    with os.scandir(path) as entries:
        return next(entries, None) is None


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


class Progress:
    """With ``options.progress``, rank 0 prints one line per step to stderr (a CPU step can take
    minutes): which step, its time, its loss and the time since :func:`run_step` started."""

    SLOW_STEP_S = 10.0

    def __init__(self, options: StepOptions, t_start: float):
        self.on = options.progress and world()[0] == 0
        self.total = 1 + options.warmup + options.steps
        self.t_start = self.t_last = t_start
        self.done = 0

    def say(self, text: str) -> None:
        if self.on:
            print(
                f"[train_8b {time.perf_counter() - self.t_start:7.1f} s] {text}", file=sys.stderr, flush=True
            )

    def begin(self, text: str) -> None:
        self.say(text)
        self.t_last = time.perf_counter()

    def phase(self, name: str) -> None:
        """A mark inside an untimed step: said only once the step has run for SLOW_STEP_S (a CPU step
        under Triton's interpreter takes minutes; a quick one stays one line)."""
        elapsed = time.perf_counter() - self.t_last
        if name in ("forward", "synced") and elapsed > self.SLOW_STEP_S:
            what = "forward" if name == "forward" else "backward"
            self.say(f"step {self.done + 1}/{self.total}: {what} done after {elapsed:.1f} s")

    def step(self, kind: str, loss: float) -> None:
        now = time.perf_counter()
        self.done += 1
        self.say(f"step {self.done}/{self.total} ({kind}) {now - self.t_last:.3f} s, loss {loss:.4f}")
        self.t_last = now


def run_step(options: StepOptions) -> dict[str, Any]:
    """Rank function (torchrun or ``launch.spawn``; ``fsdp="none"`` also in a plain process): build,
    shard and materialize the model, then one first step, ``warmup`` more, ``steps`` timed ones.

    Returns this rank's numbers: ``step_ms`` and the phase split of the timed steps, ``losses`` (every
    step's), ``first_step_s``, CUDA memory peaks over the timed steps, the bf16 matmul rate of this
    GPU (the MFU denominator), and on request the top kernels of one profiled step and the parameters.
    Also: whether the optimizer ran inside the backward and why (``optimizer_in_backward[_note]``),
    with ``course_timing`` the course protocol's figures (``course_mean_ms``, ...; its steps train the
    model further, after the timed ones), whether the caches started empty (``cold_cache``) and the
    time from process start to the end of the timing (``run_since_process_start_s``).
    """
    t_start = time.perf_counter()
    since_start = _seconds_since_process_start()
    cold = _is_empty_cache(options.cache_dir)  # before this run writes to it
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
    in_backward, in_backward_note = optimizer_in_backward_plan(options)
    if options.optimizer_in_backward and not in_backward and world()[0] == 0:
        print(f"[train_8b] optimizer in backward {in_backward_note}", file=sys.stderr, flush=True)
    tokens, targets = local_batch(options, config.vocab_size, device)
    step = functools.partial(step_once, model, optimizer, tokens, targets, grad_clip=options.grad_clip)
    world_size = world()[1]
    out: dict[str, Any] = {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "optimizer_in_backward": in_backward,  # what ran (asked: options.optimizer_in_backward)
        "optimizer_in_backward_note": in_backward_note,
        "cold_cache": cold,
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
    progress = Progress(options, t_start)
    progress.begin(f"model built on {device}; the first step compiles and tunes what it needs")
    losses = []
    with autocast:
        losses.append(step(progress.phase).item())  # synchronizes
    out["first_step_s"] = time.perf_counter() - t_start
    progress.step("first", losses[-1])
    out["first_step_since_process_start_s"] = (
        None if since_start is None else since_start + out["first_step_s"]
    )
    with autocast:
        for _ in range(options.warmup):
            losses.append(step(progress.phase).item())
            progress.step("warm-up", losses[-1])
    synchronize(device)
    if device.type == "cuda":  # the peak of the first steps (autotuning, compilation) on its own
        out["peak_first_steps_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        torch.cuda.reset_peak_memory_stats(device)
    if distributed:
        barrier(device)
    out.update(_timed_steps(step, options.steps, device, autocast, progress, losses))
    if device.type == "cuda":
        out["peak_allocated_mib"] = torch.cuda.max_memory_allocated(device) / MIB
        out["peak_reserved_mib"] = torch.cuda.max_memory_reserved(device) / MIB
        out["matmul_tflops"] = measure_matmul_tflops(device, torch.bfloat16)
    if options.course_timing:
        progress.say(
            f"course protocol: do_bench(rep={options.course_rep_ms}, warmup={options.course_warmup_ms})"
        )
        with autocast:
            out.update(course_do_bench(step, device, options.course_rep_ms, options.course_warmup_ms))
    if since_start is not None:  # process start to the end of the timing: a cold run's length
        out["run_since_process_start_s"] = since_start + time.perf_counter() - t_start
    if options.profile:
        out["profile"] = _profile_step(step, device, autocast)
    if options.return_params:
        out["params"] = full_parameters(model)
    return out


def _timed_steps(
    step: Callable[..., torch.Tensor],
    n: int,
    device: torch.device,
    autocast: contextlib.AbstractContextManager,
    progress: Progress,
    losses: list[float],
) -> dict[str, Any]:
    """``n`` synchronized steps, each timed on the host clock with its phases marked; appends their
    losses to ``losses``. Returns ``step_ms``, ``losses`` and the mean of each phase."""
    step_ms, phases = [], {phase: [] for phase in PHASES}
    for _ in range(n):
        marks = StepMarks(device)
        t0 = time.perf_counter()
        with autocast:
            loss = step(marks.mark)
        synchronize(device)
        step_ms.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
        progress.step("timed", losses[-1])
        for phase, (a, b) in PHASES.items():
            phases[phase].append(marks.ms(a, b))
    out: dict[str, Any] = {"step_ms": step_ms, "losses": losses}
    return out | {phase: statistics.fmean(v) if v else None for phase, v in phases.items()}


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
    runs near the GPU's capacity, where fixed segments left GiBs reserved but unusable (measured:
    docs/perf-notes.md, D26, the keep:auto OOM). A user's own PYTORCH_CUDA_ALLOC_CONF wins."""
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


def _profile_step(step: Callable[[], Any], device: torch.device, autocast) -> dict[str, Any]:
    """One more step under torch.profiler: device time per kernel category (communication overlaps
    compute, so the categories add up to more than the step) and the top kernels."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof, autocast:
        step()
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
