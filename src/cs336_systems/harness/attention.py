"""The attention benches' cases (D6/D7a, D11, D12): inputs, implementations by name with SDPA backend
pinning and a per-shape compile cache, and one timed pass (forward, backward or both). FLOPs live in
``profiling.flops``, device timing in ``profiling.timing``, recording rows in ``harness.record``.

Implementations by name (``impl`` in the benches):

- ``pytorch``: the annotated eager attention of the registry (handout eq. 1, causal mask adds -1e6).
- ``pytorch_compiled``: the same math under ``torch.compile(dynamic=False)``, compiled once per shape
  (see :class:`StaticCompileCache`).
- ``flash_triton``: ``FlashAttentionTriton.apply`` (our FlashAttention-2).
- ``sdpa_flash`` / ``sdpa_cudnn`` / ``sdpa_efficient``: ``F.scaled_dot_product_attention`` with its
  backend pinned by :func:`torch.nn.attention.sdpa_kernel`.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from cs336_systems.attention import AttentionFn, get_attention_fn
from cs336_systems.grading.shared.cases import LEADERBOARD_CASE
from cs336_systems.profiling.timing import synchronize
from cs336_systems.profiling.workload import DTYPES

PASSES: tuple[str, ...] = ("fwd", "bwd", "fwd_bwd")
SDPA_BACKENDS: dict[str, SDPBackend] = {
    "sdpa_flash": SDPBackend.FLASH_ATTENTION,
    "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
    "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION,
}
IMPLS: tuple[str, ...] = ("pytorch", "pytorch_compiled", "flash_triton", *SDPA_BACKENDS)

# The `attention shapes` grid (issue 14), (batch, heads, seq_q, seq_k, d, causal): short and long, few
# and many heads, d 64 and 128, xl's attention (4, 25, 512), the 8B configuration's (1, 32, 32768,
# d 128), and seq_q != seq_k; first, the leaderboard's case as batch 1 x its heads. Shared by
# bench/bench_flash.py and scripts/compare_revisions.py.
ATTENTION_SHAPES: tuple[tuple[int, int, int, int, int, bool], ...] = (
    (1, *LEADERBOARD_CASE.attention_shape, LEADERBOARD_CASE.causal),
    (4, 25, 512, 512, 64, True),
    (4, 16, 1024, 1024, 128, True),
    (8, 12, 2048, 2048, 64, True),
    (2, 32, 4096, 4096, 128, True),
    (2, 16, 8192, 8192, 64, False),
    (1, 32, 32768, 32768, 128, True),
    (1, 2, 16384, 16384, 64, True),
    (2, 16, 1024, 4096, 64, False),
)

# Beyond the grid, in the same group: the shapes the issue first tried "as a new user would" (16 x 12 x
# 1024, 8 x 16 x 2048, 1 x 1 x 16384: slower than SDPA flash then; docs/perf-notes.md, FlashAttention-2,
# "Figures moved out of docstrings") and the ends of its batch x heads range: one head of batch 256 (what
# a (batch, seq, d) input becomes), batch x heads 256 at d 128 and 512 at seq 128.
BREADTH_SHAPES: tuple[tuple[int, int, int, int, int, bool], ...] = (
    (16, 12, 1024, 1024, 64, True),
    (8, 16, 2048, 2048, 64, True),
    (1, 1, 16384, 16384, 64, False),
    (256, 1, 512, 512, 64, True),
    (32, 8, 512, 512, 128, False),
    (32, 16, 128, 128, 64, True),
)


def as_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}") from None


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

    Donated buffers are off for these graphs: the ``bwd`` pass calls ``backward(retain_graph=True)``
    on one retained forward, which a backward compiled with donated buffers refuses (torch >= 2.6
    raises "compiled with non-empty donated buffers"). The flag is read when AOTAutograd compiles,
    i.e. on the first call, so every call runs under it.
    """

    def __init__(self) -> None:
        self._key: Any = None
        self._compiled: Callable | None = None

    def get(self, fn: Callable, key: Any) -> Callable:
        full_key = (fn, key)
        if self._compiled is None or full_key != self._key:
            torch._dynamo.reset()
            compiled = torch.compile(fn, dynamic=False)

            def without_donated_buffers(*args: Any, **kwargs: Any) -> Any:
                with torch._functorch.config.patch(donated_buffer=False):
                    return compiled(*args, **kwargs)

            self._compiled = without_donated_buffers
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
