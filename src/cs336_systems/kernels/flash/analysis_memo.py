"""One mutation analysis per kernel signature, not per call site, while torch.compile traces our kernels.

For every ``wrap_triton`` launch it traces, torch asks which tensor arguments the kernel writes, and
answers by running Triton's front end to TTIR and walking the IR: at each call site, in each of several
passes (functionalization, inductor's lowering). The answer depends on the kernel, its scalar and
constexpr arguments and which arguments are tensors, never on which tensors they are; but torch keeps no
cache. The compiled xl step (48 layers, 144 launches per graph) ran the analysis 480 times, 49 s of its
66 s of cold start over SDPA's (H100, 2026-11-25, docs/perf-notes.md). :func:`memoize_analysis` wraps
torch's analysis so that our kernels are analysed once per signature; other kernels pass through.
``compat.install_analysis_memo`` installs it when the traced path first compiles (``traced.py``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable, Collection
from types import ModuleType
from typing import Any

import torch

# The analysis entry point, by torch version (2.11: the written tensors' names; 2.13: reads and writes).
ANALYSES = ("identify_mutated_tensors", "identify_accessed_tensors")


def kernel_name(kernel: Any) -> object:
    """A JITFunction's Python function by module and name (a kernel object without one: its id)."""
    fn = getattr(kernel, "fn", None)
    return (fn.__module__, fn.__qualname__) if callable(fn) else id(kernel)


def signature(kernel: Any, kwargs: dict[str, Any], rest: tuple) -> tuple:
    """What the analysis depends on: the kernel, each scalar argument's value, each tensor argument's dtype
    (fake tensors while tracing, inductor's buffers while lowering), and the TMA metadata."""

    def kind(value: Any) -> tuple:
        if isinstance(value, torch.Tensor):
            return ("tensor", value.dtype)
        if hasattr(value, "get_dtype"):  # inductor's TensorBox / buffer
            return ("tensor", value.get_dtype())
        return ("value", repr(value))

    return (kernel_name(kernel), tuple(sorted((name, kind(v)) for name, v in kwargs.items())), repr(rest))


def _copy(answer: Any) -> Any:
    """torch 2.11 answers with a list of names, which a caller may change: each caller gets its own."""
    return list(answer) if isinstance(answer, list) else answer


class AnalysisMemo:
    """Answers of ``analysis`` for ``kernels`` by :func:`signature`; ``hits`` and ``misses`` count calls.
    Kernels are matched by :func:`kernel_name`, not by hash: a set of the kernel objects let 117 of the
    small model's 153 analyses through on the H100 (a JITFunction hashes by its source hash, which Triton
    computes again later; the likely cause, not yet confirmed)."""

    def __init__(self, analysis: Callable[..., Any], kernels: Collection[Any]):
        self.analysis = analysis
        self.names: set[object] = set()
        self.answers: dict[tuple, Any] = {}
        self.hits = self.misses = 0
        self._lock = threading.Lock()
        self.add(kernels)

    def add(self, kernels: Collection[Any]) -> None:
        self.names |= {kernel_name(k) for k in kernels}

    def __call__(self, kernel: Any, kwargs: dict[str, Any], *rest: Any) -> Any:
        if kernel_name(kernel) not in self.names:
            return self.analysis(kernel, kwargs, *rest)
        key = signature(kernel, kwargs, rest)
        with self._lock:
            if key in self.answers:
                self.hits += 1
                return _copy(self.answers[key])
        answer = self.analysis(kernel, kwargs, *rest)
        with self._lock:
            self.misses += 1
            self.answers[key] = _copy(answer)
        return answer


def memoize_analysis(kernels: Collection[Any], module: ModuleType | None = None) -> AnalysisMemo | None:
    """Wrap torch's mutation analysis (in ``module``, default torch's ``triton_kernel_wrap``) with a memo
    for ``kernels`` (once; later calls add kernels to it); returns the memo, or None where this torch has
    no analysis by a known name."""
    if module is None:
        import torch._higher_order_ops.triton_kernel_wrap as module
    for name in ANALYSES:
        current = getattr(module, name, None)
        if isinstance(current, AnalysisMemo):
            current.add(kernels)
            return current
        if current is not None:
            memo = AnalysisMemo(current, kernels)
            # Modules that imported the analysis by name hold the function itself: each gets the memo.
            # (Their __dict__ is read, not getattr: a module's lazy __getattr__ may import or warn.)
            for holder in [module, *list(sys.modules.values())]:
                if getattr(holder, "__dict__", {}).get(name) is current:
                    setattr(holder, name, memo)
            return memo
    return None
