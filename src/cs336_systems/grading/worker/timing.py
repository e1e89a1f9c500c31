"""Timing a student's FlashAttention in its own process, for the benches' ``adapters`` rows.

``leaderboard``: the 2025 leaderboard's case, ``cases.LEADERBOARD_CASE`` (``q, k, v = torch.randn(3,
*shape)`` in bf16, one leaf unpacked, ``flash = torch.compile(apply)``, ``flash(q, k, v,
True).sum().backward()``; the eager ``apply`` where compiling fails, and the row says why), timed twice:
by the parent's clock over iterations the parent verifies (``clock.py``), and the course's way,
``triton.testing.do_bench(rep, warmup)`` mean with gradients never zeroed, here in the graded process
(its own word, shown beside).
``attention``: forward and backward times of one (batch, seq, d) case, as the D6 grid times its rows.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch

from ..shared.cases import LEADERBOARD_CASE, TRITON_HOOK
from ..shared.dtypes import DTYPES
from .clock import serve_round
from .hooks import Hooks
from .provenance import Recorder


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def _failure(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {str(exc)[:4000]}"


def leaderboard(hooks: Hooks, args: dict[str, Any], roots: list[str], job: dict) -> dict:
    """Warm up, then the parent's clock (``clock.serve_round`` for each round the parent asks for), then
    the course's own figure: ``do_bench`` here, in this process, the graded process's word (reported
    beside the parent's, never ranked on). With ``observe``, one round whose calls an observer outside this
    process records (``clock.iterations``), and nothing else."""
    fn = getattr(hooks, TRITON_HOOK)()
    shape = tuple(args["shape"])
    device = torch.device(args.get("device", "cuda"))
    dtype = args.get(
        "dtype", LEADERBOARD_CASE.dtype
    )  # fp32: the CPU's stand-in (Triton's interpreter mishandles bf16)
    q, k, v = torch.randn(3, *shape, device=device, dtype=DTYPES[dtype], requires_grad=True)
    causal = LEADERBOARD_CASE.causal
    result: dict[str, Any] = {"compiled": True, "compile_error": None}
    torch._dynamo.reset()
    flash = torch.compile(fn.apply) if args.get("compile", True) else fn.apply
    started = time.monotonic()
    try:
        flash(q, k, v, causal).sum().backward()
    except Exception as exc:
        result.update(compiled=False, compile_error=_failure(exc))
        flash = fn.apply
    if not args.get("compile", True):
        result.update(compiled=False, compile_error="not compiled: asked for eager")
    result["compile_s"] = round(time.monotonic() - started, 1)
    call = lambda q, k, v: flash(q, k, v, causal)
    call(q, k, v).sum().backward()  # the eager fallback's first call compiles its kernels too
    for round_ in range(args["rounds"]):  # the rounds and their waits: the parent's plan (its time limits)
        serve_round(
            call, round_, job, shape, device, dtype, args["wait_s"], observed=bool(args.get("observe"))
        )
    if args.get("observe"):
        return result
    recorder = Recorder()
    started = time.monotonic()
    try:
        with recorder.active():
            flash(q, k, v, causal).sum().backward()
            _synchronize(device)
    except Exception as exc:
        return {**result, "error": _failure(exc), "provenance": recorder.report(roots)}
    result["provenance"] = recorder.report(roots)
    result["recorded_s"] = round(time.monotonic() - started, 1)
    if not args.get("rep"):
        return result
    started = time.monotonic()
    try:
        from triton.testing import do_bench

        times = do_bench(
            lambda: flash(q, k, v, causal).sum().backward(),
            rep=args["rep"],
            warmup=args["warmup"],
            return_mode="all",
        )
    except Exception as exc:
        return {**result, "error": ("oom: " if _is_oom(exc) else "") + _failure(exc)}
    result["do_bench_s"] = round(time.monotonic() - started, 1)
    return {**result, "mean_ms": course_figure(times), "times_ms": list(times)}


def course_figure(times: list[float]) -> float:
    """The course's leaderboard figure: the mean of ``do_bench``'s times (not their median: a kernel
    whose every tenth call is slow pays for it, as on the course's board)."""
    return statistics.fmean(times)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def attention(hooks: Hooks, args: dict[str, Any], roots: list[str], job: dict) -> dict:
    """Per-pass forward and backward wall times (synchronized), the memory held before backward, and
    what the last pass ran (``provenance``)."""
    fn = getattr(hooks, TRITON_HOOK)()
    batch, seq, d = args["batch"], args["seq"], args["d"]
    recorder = Recorder()
    fwd, bwd, phase, mem = [], [], "inputs", None
    try:
        q, k, v = (
            torch.randn(batch, seq, d, device="cuda", dtype=DTYPES[args["dtype"]], requires_grad=True)
            for _ in range(3)
        )
        dout = torch.randn_like(q)
        for i in range(args["warmup"] + args["passes"]):
            q.grad = k.grad = v.grad = None
            phase = "fwd"
            start = time.perf_counter()
            out = fn.apply(q, k, v, args["causal"])
            torch.cuda.synchronize()
            mid = time.perf_counter()
            mem = torch.cuda.memory_allocated() / 2**20
            phase = "bwd"
            out.backward(dout)
            torch.cuda.synchronize()
            if i >= args["warmup"]:
                fwd.append((mid - start) * 1e3)
                bwd.append((time.perf_counter() - mid) * 1e3)
        with recorder.active():
            fn.apply(q, k, v, args["causal"]).backward(dout)
    except Exception as exc:
        if _is_oom(exc):
            return {"oom": True, "phase": phase, "mem_before_bwd_mib": mem}
        raise
    return {"fwd_ms": fwd, "bwd_ms": bwd, "mem_before_bwd_mib": mem, "provenance": recorder.report(roots)}


# -- data-parallel steps: the student's wrapper beside torch's, on one workload, in the same ranks ----


def _mlp(d_model: int, layers: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    blocks = [
        torch.nn.Sequential(
            torch.nn.Linear(d_model, 4 * d_model), torch.nn.GELU(), torch.nn.Linear(4 * d_model, d_model)
        )
        for _ in range(layers)
    ]
    return torch.nn.Sequential(*blocks).to(device)


def _device(backend: str) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")


def _timed_steps(step, warmup: int, steps: int, device: torch.device) -> list[float]:
    import torch.distributed as dist

    times = []
    for i in range(warmup + steps):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _slowest_rank(times: list[float]) -> list[float]:
    from .dist import gather

    return [max(ts) for ts in zip(*gather(times), strict=True)]


def ddp(hooks: Hooks, args: dict[str, Any], roots: list[str], job: dict) -> dict:
    """Training steps (forward, backward, the after-backward hook, AdamW) of an MLP of
    ``layers`` x (d -> 4d -> d) with the adapters' DDP (bucketed when ``bucket_mb`` is given) and with
    ``torch.nn.parallel.DistributedDataParallel`` (the same bucket size), slowest rank per step."""
    from torch.nn.parallel import DistributedDataParallel

    device = _device(args["backend"])
    bucket_mb = args.get("bucket_mb")
    names = (
        ("get_ddp_bucketed", "ddp_bucketed_on_train_batch_start", "ddp_bucketed_on_after_backward")
        if bucket_mb
        else None
    )
    if names is None:
        individual = args.get("individual_hook", "get_ddp_individual_parameters")
        after = (
            "ddp_on_after_backward"
            if individual == "get_ddp"
            else "ddp_individual_parameters_on_after_backward"
        )
        ours = getattr(hooks, individual)(_mlp(args["d_model"], args["layers"], device))
    else:
        ours = getattr(hooks, names[0])(_mlp(args["d_model"], args["layers"], device), bucket_mb)
        after = names[2]
    theirs = DistributedDataParallel(
        _mlp(args["d_model"], args["layers"], device), bucket_cap_mb=bucket_mb or 25
    )
    x = torch.randn(args["batch"], args["d_model"], device=device)
    result = {"params": sum(p.numel() for p in ours.parameters())}
    for name, model in (("adapters", ours), ("torch_ddp", theirs)):
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(model=model, opt=opt) -> None:
            opt.zero_grad(set_to_none=True)
            if model is ours and names is not None:
                getattr(hooks, names[1])(model, opt)
            model(x).square().mean().backward()
            if model is ours:
                getattr(hooks, after)(model, opt)
            opt.step()

        result[f"{name}_ms"] = _slowest_rank(_timed_steps(step, args["warmup"], args["steps"], device))
    return result


def sharded(hooks: Hooks, args: dict[str, Any], roots: list[str], job: dict) -> dict:
    """Optimizer steps of the adapters' ``get_sharded_optimizer(params, AdamW)`` beside torch's
    ``ZeroRedundancyOptimizer`` and plain AdamW on the same MLP (gradients given): step time and the
    optimizer state each rank holds."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from ..shared.training import held_optimizers

    device = _device(args["backend"])
    model = _mlp(args["d_model"], args["layers"], device)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    makers = {
        "adapters": lambda ps: hooks.get_sharded_optimizer(ps, torch.optim.AdamW, lr=1e-4),
        "torch_zero": lambda ps: ZeroRedundancyOptimizer(ps, optimizer_class=torch.optim.AdamW, lr=1e-4),
        "unsharded": lambda ps: torch.optim.AdamW(ps, lr=1e-4),
    }
    result: dict[str, Any] = {"params": sum(p.numel() for p in model.parameters())}
    for name, make in makers.items():
        opt = make(list(model.parameters()))
        result[f"{name}_ms"] = _slowest_rank(_timed_steps(opt.step, args["warmup"], args["steps"], device))
        state = sum(
            v.numel() * v.element_size()
            for o in held_optimizers(opt)
            for s in o.state.values()
            for v in s.values()
            if isinstance(v, torch.Tensor)
        )
        result[f"{name}_state_mib"] = state / 2**20
    return result
