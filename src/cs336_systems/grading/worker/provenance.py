"""What one call of a student's attention ran, recorded beside it: the Triton kernels it launched (name
and source file), the Triton kernels defined in the repository's files, and what torch.profiler saw
(aten operators; on a GPU, the kernels). The judging process decides from these whether a kernel of
the repository's own ran and whether torch's attention ran instead; nothing is decided here.

Launches are recorded by wrapping ``JITFunction.run`` (and the interpreter's ``InterpretedFunction.run``),
which every eager launch goes through (``kernel[grid](...)`` and autotuners alike). A call compiled by
``torch.compile`` launches user kernels through inductor instead: there the profiler's kernel names,
matched against the repository's kernel names, tell.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from ..shared.repository import ENVIRONMENT_DIRS


def _triton_classes() -> tuple[type, ...]:
    found = []
    with contextlib.suppress(ImportError):
        from triton.runtime.jit import JITFunction

        found.append(JITFunction)
    with contextlib.suppress(ImportError):
        from triton.runtime.interpreter import InterpretedFunction

        found.append(InterpretedFunction)
    return tuple(found)


@functools.cache
def _kernel_interface() -> type | None:
    """Triton's base of kernel objects (JIT functions, autotuners), imported once: the check runs on every
    value of every module the repository loaded."""
    try:
        from triton.runtime.jit import KernelInterface
    except ImportError:
        return None
    return KernelInterface


def _kernel_source(obj: Any) -> tuple[str, str] | None:
    """(name, source file) of a Triton kernel object (a JIT function, or an autotuner / heuristics
    wrapping one), None for anything else."""
    interface = _kernel_interface()
    if interface is not None:
        if not isinstance(obj, interface):
            return None
        fn = obj
        for _ in range(8):  # Autotuner -> Heuristics -> JITFunction -> the Python function
            if inspect.isfunction(fn):
                break
            fn = getattr(fn, "fn", None)
        if inspect.isfunction(fn):
            return fn.__name__, str(Path(inspect.getsourcefile(fn) or "").resolve())
    return None


def repository_kernels(roots: list[str]) -> dict[str, str]:
    """Triton kernels defined in modules loaded from ``roots`` (module attributes and class attributes
    one level down): name -> source file."""
    folders = tuple(Path(r).resolve() for r in roots)
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if not file or not _repositorys(file, folders):
            continue
        values = list(vars(module).values())
        values += [v for cls in values if inspect.isclass(cls) for v in vars(cls).values()]
        for value in values:
            source = _kernel_source(value.__func__ if isinstance(value, staticmethod) else value)
            if source and any(Path(source[1]).is_relative_to(f) for f in folders):
                found.setdefault(*source)
    return found


@functools.cache
def _repositorys(file: str, folders: tuple[Path, ...]) -> bool:
    """Whether a module's file is the repository's own code: under one of its folders, and not in a Python
    environment there (the grading environment may itself sit in a repository's folder, as tox's does in
    the suite's: its thousands of modules were scanned for kernels at every case)."""
    path = Path(file).resolve()
    for folder in folders:
        if path.is_relative_to(folder):
            return not ENVIRONMENT_DIRS.intersection(path.relative_to(folder).parts)
    return False


def _events(profiler: torch.profiler.profile) -> Iterator[tuple[str, Any, float]]:
    """(name, device type, duration in ms) of every event the profiler kept. Read from the raw results:
    building ``key_averages()`` parses every event into a tree first, an order of magnitude slower for a
    call of tens of thousands of small operators (docs/grading.md has the figure), and a backward written
    in PyTorch operators at the leaderboard's shape is such a call."""
    results = getattr(profiler.profiler, "kineto_results", None)
    if results is None:
        yield from ((e.key, e.device_type, 0.0) for e in profiler.key_averages())
        return
    yield from ((e.name(), e.device_type(), e.duration_ns() / 1e6) for e in results.events())


class Recorder:
    """Records Triton launches and profiler names while active (``with recorder.active(): ...``); the
    record survives an exception raised inside, so a call that raised still tells what it launched."""

    def __init__(self) -> None:
        self.launched: list[list[str]] = []
        self.operators: set[str] = set()  # what the profiler saw on the host (aten operators, ...)
        self.kernels: set[str] = set()  # what it saw run on a GPU
        self.gpu_ms: dict[str, dict[str, float]] = {}  # phase -> kernel name -> GPU time

    @contextlib.contextmanager
    def active(self, phase: str = "call") -> Iterator[None]:
        classes = _triton_classes()
        originals = {cls: cls.run for cls in classes}

        def wrap(cls: type):
            def run(kernel: Any, *args: Any, **kwargs: Any) -> Any:
                source = _kernel_source(kernel)
                if source and not kwargs.get("warmup", False) and list(source) not in self.launched:
                    self.launched.append(list(source))
                return originals[cls](kernel, *args, **kwargs)

            return run

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        for cls in classes:
            cls.run = wrap(cls)
        profiler = torch.profiler.profile(activities=activities)
        try:
            with profiler:
                yield
        finally:
            for cls, run in originals.items():
                cls.run = run
            with contextlib.suppress(Exception):
                times = self.gpu_ms.setdefault(phase, {})
                for name, device_type, ms in _events(profiler):
                    on_gpu = device_type == torch.autograd.DeviceType.CUDA
                    (self.kernels if on_gpu else self.operators).add(name)
                    if on_gpu:
                        times[name] = times.get(name, 0.0) + ms

    def report(self, roots: list[str]) -> dict[str, Any]:
        """Plain data for the judging process."""
        return {
            "launched": self.launched,
            "repository_kernels": repository_kernels(roots),
            "operators": sorted(n for n in self.operators if n.startswith("aten::"))[:2000],
            "kernels": sorted(self.kernels)[:2000],
            "gpu_ms": {
                p: dict(sorted(t.items(), key=lambda kv: -kv[1])[:200]) for p, t in self.gpu_ms.items()
            },
        }
