"""One annotation that shows up both in ``nsys`` (NVTX) and in ``torch.profiler`` (record_function)."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

import torch


class annotate(contextlib.ContextDecorator):
    """NVTX range + profiler record_function; usable as a context manager or a decorator.

    NVTX is only pushed when CUDA is present (it is a no-op elsewhere anyway); record_function costs
    a few microseconds, negligible against the kernels it labels. Inside a ``torch.compile`` trace the
    range is skipped: dynamo cannot trace ``record_function.__enter__`` and would split the graph at
    every annotated call (one break per attention layer), which is what the compiled benches must avoid.
    """

    def __init__(self, name: str):
        self.name = name
        self._stack: contextlib.ExitStack | None = None

    def __enter__(self) -> annotate:
        if torch.compiler.is_compiling():
            return self
        self._stack = contextlib.ExitStack()
        if torch.cuda.is_available():
            self._stack.enter_context(torch.cuda.nvtx.range(self.name))
        self._stack.enter_context(torch.profiler.record_function(self.name))
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._stack is None:  # entered while compiling
            return
        self._stack.close()
        self._stack = None

    def __call__(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            # A fresh instance per call: the decorator object itself is shared and must stay reentrant.
            with annotate(self.name):
                return fn(*args, **kwargs)

        return wrapper
