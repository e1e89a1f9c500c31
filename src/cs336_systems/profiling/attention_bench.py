"""Shared logic of the attention benches (D6/D7a, D11, D12): FLOP counts, inputs, implementations by
name, SDPA backend pinning, device timing with ``triton.testing.do_bench``, rows for cases that did not
run, and a crash-safe row log (``CS336_BENCH_JSONL``) that ``python -m cs336_systems.report`` reads
like the JSON the benches write.

Implementations by name (``impl`` in the benches):

- ``pytorch``: the annotated eager attention of the registry (handout eq. 1, causal mask adds -1e6).
- ``pytorch_compiled``: the same math under ``torch.compile(dynamic=False)``, compiled once per shape
  (see :class:`StaticCompileCache`).
- ``flash_triton``: ``FlashAttentionTriton.apply`` (our FlashAttention-2).
- ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient``: ``F.scaled_dot_product_attention`` with its
  backend pinned by :func:`torch.nn.attention.sdpa_kernel`.

Run ``python -m cs336_systems.profiling.attention_bench OUT.json [MORE.json|.jsonl ...]`` to print the
D6/D7a, D11 and D12 tables as Markdown from pytest-benchmark JSON (or from the per-case JSONL log that
``CS336_BENCH_JSONL=path`` makes the benches append, which survives a run that is killed mid-way).
"""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import os
import statistics
import timeit
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import AttentionFn, get_attention_fn
from cs336_systems.profiling.timing import synchronize
from cs336_systems.profiling.workload import DTYPES

PASSES: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")
# Backward does 2.5x the forward's matmul FLOPs (5 matmuls against 2, with P recomputed in FA2), the
# convention of the FlashAttention papers; fwd_bwd is the sum.
PASS_FLOP_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
IMPLS: tuple[str, ...] = ("pytorch", "pytorch_compiled", "flash_triton", *SDPA_BACKENDS)


def env_int(name: str, default: int) -> int:
    """An integer knob from the environment (the bench options of bench/conftest.py are shared)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


# --------------------------------------------------------------------------------------------- FLOPs


def attention_flops(
    batch: int,
    seq: int,
    d: int,
    *,
    heads: int = 1,
    causal: bool = True,
    pass_: str = "fwd",
    n_keys: int | None = None,
) -> float:
    """Matmul FLOPs of attention: forward = 2 matmuls (Q K^T and P V) of seq x n_keys x d multiply-adds,
    2 FLOPs each, i.e. 4 * seq * n_keys * d per (batch, head); causal halves it (half the tiles are
    masked); backward = 2.5 x forward. Softmax and masking are not counted (they are not matmuls)."""
    if pass_ not in PASS_FLOP_FACTOR:
        raise ValueError(f"unknown pass {pass_!r}; choose one of {list(PASS_FLOP_FACTOR)}")
    n_keys = seq if n_keys is None else n_keys
    fwd = 4.0 * batch * heads * seq * n_keys * d
    if causal:
        fwd *= 0.5
    return fwd * PASS_FLOP_FACTOR[pass_]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


# -------------------------------------------------------------------------------------------- inputs


def make_qkv(
    batch: int,
    seq: int,
    d: int,
    dtype: str | torch.dtype,
    device: torch.device | str,
    *,
    heads: int | None = None,
    requires_grad: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random q, k, v of shape (batch, seq, d), or (batch, heads, seq, d) when ``heads`` is given;
    standard normal, drawn on the device from a seeded generator so every case sees the same data."""
    shape = (batch, seq, d) if heads is None else (batch, heads, seq, d)
    gen = torch.Generator(device=device).manual_seed(seed)
    make = functools.partial(
        torch.randn, shape, device=device, dtype=as_dtype(dtype), generator=gen, requires_grad=requires_grad
    )
    return make(), make(), make()


def make_grad(out_like: torch.Tensor, seed: int = 1) -> torch.Tensor:
    """A fixed random upstream gradient dO for backward passes."""
    gen = torch.Generator(device=out_like.device).manual_seed(seed)
    return torch.randn(out_like.shape, device=out_like.device, dtype=out_like.dtype, generator=gen)


# ----------------------------------------------------------------------------------- implementations


def sdpa_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool = False
) -> torch.Tensor:
    """torch SDPA; (batch, seq, d) inputs get a head axis because the fused backends want 4-D input."""
    if q.dim() == 3:
        return F.scaled_dot_product_attention(q[:, None], k[:, None], v[:, None], is_causal=is_causal)[:, 0]
    return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)


def impl_context(impl: str) -> contextlib.AbstractContextManager:
    """Pins the SDPA backend for ``sdpa_*`` impls (forward picks the kernel, backward follows it)."""
    return sdpa_kernel(SDPA_BACKENDS[impl]) if impl in SDPA_BACKENDS else contextlib.nullcontext()


@functools.cache
def sdpa_unsupported_reason(impl: str, dtype: torch.dtype, d: int, device_type: str) -> str | None:
    """None when the pinned SDPA backend runs causal forward+backward at this dtype and head dim on
    this device (probed on a tiny input, so it reflects this build and GPU), else the reason."""
    if impl not in SDPA_BACKENDS:
        raise ValueError(f"{impl!r} is not an SDPA backend; choose one of {list(SDPA_BACKENDS)}")
    q, k, v = make_qkv(1, 256, d, dtype, device_type, heads=1)
    with warnings.catch_warnings(record=True) as caught, sdpa_kernel(SDPA_BACKENDS[impl]):
        warnings.simplefilter("always")
        try:
            sdpa_attention(q, k, v, is_causal=True).sum().backward()
            synchronize(q.device)
        except RuntimeError as exc:
            # torch explains why a backend was refused in warnings; the error itself is generic.
            why = [str(w.message).splitlines()[0] for w in caught] or [str(exc).splitlines()[0]]
            return f"{impl} unsupported for {dtype} d={d} on {device_type}: " + "; ".join(why)
    return None


def is_unsupported_error(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, RuntimeError) and ("No available kernel" in text or "No viable backend" in text)


def load_flash_triton() -> type[torch.autograd.Function]:
    """Our FlashAttention-2 autograd.Function, or a clear error while the kernels have not landed."""
    try:
        from cs336_systems.attention.flash_triton import FlashAttentionTriton
    except ImportError as exc:
        raise RuntimeError(
            "impl 'flash_triton' needs cs336_systems.attention.flash_triton.FlashAttentionTriton "
            f"(the FlashAttention kernels issue), which cannot be imported: {exc}"
        ) from exc
    return FlashAttentionTriton


class StaticCompileCache:
    """``torch.compile(fn, dynamic=False)`` for one shape at a time.

    Static shapes give every case the kernels a fixed-shape model would get. Dynamo keys its cache on the
    code object and stops recompiling after ``recompile_limit`` (8) shapes, falling back to eager; so
    when the shape key changes, dynamo is reset and a fresh compile starts. Cases of the same shape
    (the fwd / bwd / fwd_bwd passes) run back to back and share one compile.
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._compiled: Callable | None = None

    def get(self, fn: Callable, key: Any) -> Callable:
        full_key = (fn, key)
        if self._compiled is None or full_key != self._key:
            torch._dynamo.reset()
            self._compiled = torch.compile(fn, dynamic=False)
            self._key = full_key
        return self._compiled


_COMPILED = StaticCompileCache()


def eager_attention() -> AttentionFn:
    return get_attention_fn("pytorch")


def compilable_attention() -> AttentionFn:
    """The plain math the registry's ``pytorch_compiled`` compiles (without NVTX ranges, which would
    break the graph), unwrapped so that it can be recompiled with static shapes."""
    compiled = get_attention_fn("pytorch_compiled")
    original = getattr(compiled, "_torchdynamo_orig_callable", None)
    if original is None:
        raise RuntimeError("registry entry 'pytorch_compiled' is not a torch.compile'd function")
    return original


def resolve_impl(impl: str, shape_key: Any) -> AttentionFn:
    """The attention function ``fn(q, k, v, is_causal)`` for an impl name."""
    if impl == "pytorch":
        return eager_attention()
    if impl == "pytorch_compiled":
        return _COMPILED.get(compilable_attention(), shape_key)
    if impl == "flash_triton":
        return load_flash_triton().apply
    if impl in SDPA_BACKENDS:
        return sdpa_attention
    raise ValueError(f"unknown attention impl {impl!r}; choose one of {list(IMPLS)}")


class PassStep:
    """One timed pass of attention: ``fwd`` (training forward: graph recorded, activations saved),
    ``bwd`` (``out.backward(dO, retain_graph=True)`` on one retained forward) or ``fwd_bwd``.
    ``grads`` are the tensors whose .grad must be reset between reps; ``close()`` drops the retained
    graph so its memory is freed before the next case."""

    def __init__(
        self,
        fn: AttentionFn,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        pass_: str,
        is_causal: bool = True,
    ):
        if pass_ not in PASSES:
            raise ValueError(f"unknown pass {pass_!r}; choose one of {list(PASSES)}")
        self.fn, self.q, self.k, self.v, self.pass_ = fn, q, k, v, pass_
        self.is_causal = is_causal
        self.grads = [q, k, v]
        self.out: torch.Tensor | None = None
        # dO has the output's shape, which is q's (v has q's head dim in every case here); no probe
        # call, which would cost a compiled impl an extra no-grad compile.
        self.dout: torch.Tensor | None = make_grad(q)
        if pass_ == "bwd":
            self.out = fn(q, k, v, is_causal)

    def __call__(self) -> None:
        if self.pass_ == "fwd":
            self.fn(self.q, self.k, self.v, self.is_causal)
        elif self.pass_ == "bwd":
            assert self.out is not None, "PassStep used after close()"
            self.out.backward(self.dout, retain_graph=True)
        else:
            self.fn(self.q, self.k, self.v, self.is_causal).backward(self.dout)

    def zero_grads(self) -> None:
        for t in self.grads:
            t.grad = None

    def close(self) -> None:
        self.zero_grads()
        self.out = self.dout = None


# -------------------------------------------------------------------------------------------- timing


def quantile(values: Sequence[float], q: float) -> float:
    return float(np.quantile(np.asarray(values, dtype=float), q))


def host_bench(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
    max_reps: int = 100,
) -> list[float]:
    """do_bench's protocol with a host clock and a synchronize per rep, for devices without a Triton
    driver (the CPU variants): one call, an estimate of 5, warm-up and reps sized by time. Reps are
    capped at ``max_reps`` because a busy shared CPU makes the 5-call estimate unreliable."""
    fn()
    synchronize(device)
    start = timeit.default_timer()
    for _ in range(5):
        fn()
    synchronize(device)
    estimate_ms = max((timeit.default_timer() - start) * 1e3 / 5, 1e-6)
    for _ in range(min(max_reps, max(1, int(warmup_ms / estimate_ms)))):
        fn()
    times = []
    for _ in range(min(max_reps, max(1, int(rep_ms / estimate_ms)))):
        for t in grad_to_none or ():
            t.grad = None
        start = timeit.default_timer()
        fn()
        synchronize(device)
        times.append((timeit.default_timer() - start) * 1e3)
    return times


def device_time(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup_ms: float,
    rep_ms: float,
    grad_to_none: Sequence[torch.Tensor] | None = None,
) -> dict[str, Any]:
    """Device time of ``fn`` per call: ``triton.testing.do_bench`` on CUDA (CUDA events around each rep,
    L2 flushed between reps, grads of ``grad_to_none`` reset), the host-clock twin elsewhere. The median
    is the authoritative number (``do_bench_ms``); 20/80 % quantiles and min go alongside."""
    if device.type == "cuda":
        from triton.testing import do_bench

        times = do_bench(
            fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none or []), return_mode="all"
        )
        timer = "do_bench"
    else:
        times = host_bench(fn, device, warmup_ms=warmup_ms, rep_ms=rep_ms, grad_to_none=grad_to_none)
        timer = "host"
    return {
        "timer": timer,
        "do_bench_ms": statistics.median(times),
        "do_bench_p20_ms": quantile(times, 0.2),
        "do_bench_p80_ms": quantile(times, 0.8),
        "do_bench_min_ms": min(times),
        "do_bench_reps": len(times),
    }


def rounds_for(ms: float, budget_ms: float = 100.0, lo: int = 3, hi: int = 20) -> int:
    """How many synchronized pytest-benchmark rounds to add after do_bench: about ``budget_ms`` of work,
    at least ``lo`` (so stddev exists), at most ``hi``."""
    return int(min(hi, max(lo, budget_ms // max(ms, 1e-6))))


def release_memory(device: torch.device, *, collect: bool = False) -> None:
    """Return cached device blocks between big cases; ``collect`` also runs the garbage collector,
    needed only after an exception (its traceback cycles keep tensors alive). Skipped off CUDA, and
    gc is not run per case because one collection costs 0.1-0.3 s with torch/inductor loaded."""
    if device.type != "cuda":
        return
    if collect:
        gc.collect()
    torch.cuda.empty_cache()


def memory_allocated_mib(device: torch.device) -> float | None:
    return torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None


def environment_info(device: torch.device) -> dict[str, Any]:
    """What the tables need to name the machine (``device_name``, as the report generator reads it),
    library versions, and whether fp32 matmuls use TF32."""
    import triton

    return {
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "fp32_matmul_tf32": torch.backends.cuda.matmul.allow_tf32,
    }


# ------------------------------------------------------------------------------------ recording rows


def record_not_run(benchmark: Any, status: str, reason: str, **extra_info: Any) -> None:
    """A result row for a case that was deliberately not run (``status`` "unsupported" or "skipped"),
    with the reason, so the table shows it instead of a hole; timing is a no-op like an OOM row.
    ``skipped`` carries the reason too: the report generator leaves such rows out of plots."""
    benchmark.extra_info.update(extra_info, status=status, reason=reason, skipped=reason, oom=False)
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)


def log_case(benchmark: Any) -> None:
    """Append this case as one JSON line to ``$CS336_BENCH_JSONL`` when set, in the shape of a
    pytest-benchmark JSON entry, so a sweep killed by a time limit still leaves its finished rows."""
    path = os.environ.get("CS336_BENCH_JSONL")
    if not path:
        return
    stats = getattr(getattr(benchmark, "stats", None), "stats", None)
    row = {
        "group": getattr(benchmark, "group", None),
        "name": getattr(benchmark, "name", None),
        "params": getattr(benchmark, "params", None),
        "extra_info": dict(benchmark.extra_info),
        "stats": stats.as_dict() if stats is not None else None,
    }
    with open(path, "a") as fh:
        fh.write(json.dumps(row, default=str) + "\n")
