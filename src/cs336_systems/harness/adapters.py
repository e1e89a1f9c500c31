"""Any implementation through its grading hooks: load an adapters file by path and call its hooks.

The course's graders reach an implementation only through ``tests/adapters.py``; the contract tests
(``tests/contract/``) and the benches' ``adapters`` rows do the same, with any file a student points
them at (``--adapters PATH`` or ``CS336_ADAPTERS``). A hook the file does not define, or one that
raises ``NotImplementedError`` itself (the course's blank template), is *not implemented*: callers
skip it by name instead of failing. A ``NotImplementedError`` raised deeper, inside the student's
code, is a real error and propagates.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.util
import inspect
import os
import sys
import textwrap
import types
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

ENV_VAR = "CS336_ADAPTERS"
OPTION = "--adapters"
IMPL = "adapters"  # the implementation value of the benches' adapters rows

# An adapters row exists only when an adapters file is given: `adapters_param` marks it with this
# marker and the root conftest drops the marked cases otherwise.
MARKER = "adapters_row"
TRITON_HOOK = "get_flashattention_autograd_function_triton"


class HookNotImplemented(Exception):
    """The adapters file lacks ``hook`` or the hook raises ``NotImplementedError`` itself."""

    def __init__(self, hook: str, why: str):
        super().__init__(f"hook {hook} {why}")
        self.hook = hook

    @property
    def skip_reason(self) -> str:
        return f"{self.hook}: not implemented ({self.args[0]})"


def requested_path(option_value: str | None) -> Path | None:
    """The adapters file asked for: the option, else the environment variable, else None."""
    value = option_value or os.environ.get(ENV_VAR) or None
    if value is None:
        return None
    path = Path(value).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"{OPTION} / {ENV_VAR}: no adapters file at {path}")
    return path


@functools.cache
def load_adapters(path: str | Path) -> types.ModuleType:
    """The module at ``path``, imported by file path (any name, any folder) once per process.
    Its folder goes on ``sys.path`` so that it may import its neighbours, as the course's file does."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"no adapters file at {path}")
    name = f"cs336_adapters_{hashlib.sha1(str(path).encode()).hexdigest()[:10]}"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as a Python module")
    module = importlib.util.module_from_spec(spec)
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _raised_by_hook(exc: BaseException, fn: Callable) -> bool:
    """Whether ``exc`` was raised in ``fn``'s own body (its last traceback frame is ``fn``'s code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is getattr(fn, "__code__", None)


def call_hook(module: types.ModuleType, hook: str, *args: Any, **kwargs: Any) -> Any:
    """``module.<hook>(*args, **kwargs)``; raises :class:`HookNotImplemented` when the hook is missing
    or is a blank that raises ``NotImplementedError`` itself."""
    fn = getattr(module, hook, None)
    if fn is None:
        raise HookNotImplemented(hook, f"is not defined in {module.__file__}")
    try:
        return fn(*args, **kwargs)
    except NotImplementedError as exc:
        if _raised_by_hook(exc, fn):
            raise HookNotImplemented(hook, "raises NotImplementedError") from None
        raise


def _is_not_implemented(node: ast.expr | None) -> bool:
    target = node.func if isinstance(node, ast.Call) else node
    return isinstance(target, ast.Name) and target.id == "NotImplementedError"


def blank_hook(module: types.ModuleType, hook: str) -> HookNotImplemented | None:
    """Why ``hook`` is not implemented, read from the source without calling it (a hook may need a
    process group to be called): missing, or a body that only raises ``NotImplementedError`` (after an
    optional docstring). None when it has a body of its own."""
    fn = getattr(module, hook, None)
    if fn is None:
        return HookNotImplemented(hook, f"is not defined in {module.__file__}")
    try:
        body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    except (OSError, TypeError, SyntaxError, IndexError, AttributeError):
        return None  # no readable source: find out by calling it
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    if len(body) == 1 and isinstance(body[0], ast.Raise) and _is_not_implemented(body[0].exc):
        return HookNotImplemented(hook, "raises NotImplementedError")
    return None


def flash_function(path: str | Path, kind: str = "triton") -> type | None:
    """The adapters' FlashAttention ``autograd.Function`` (``kind`` triton or pytorch), or None when
    that hook is not implemented."""
    hook = f"get_flashattention_autograd_function_{kind}"
    try:
        return call_hook(load_adapters(path), hook)
    except HookNotImplemented:
        return None


def flash_apply(path: str | Path | None, compiled: bool = False) -> Callable:
    """The adapters' Triton FlashAttention as ``fn(q, k, v, is_causal)`` for a bench row
    (``torch.compile``'d as the leaderboard does when ``compiled``); skips the case, naming the hook,
    when it is not implemented."""
    if path is None:
        raise ValueError(f"an 'adapters' case needs an adapters file ({OPTION} or {ENV_VAR})")
    try:
        fn = call_hook(load_adapters(path), TRITON_HOOK)
    except HookNotImplemented as exc:
        pytest.skip(exc.skip_reason)
    if not compiled:
        return fn.apply
    torch._dynamo.reset()
    return torch.compile(fn.apply)


def row_marks(value: Any, *hooks: str) -> list:
    """The marks of a bench case: for the adapters' value, the row marker naming the hooks the row
    needs (``"a|b"``: either), so that the root conftest drops it without ``--adapters`` and skips it,
    naming the hook, when a hook is not implemented; none for any other value."""
    return [getattr(pytest.mark, MARKER)(*hooks)] if value == IMPL else []


def adapters_param(*values: Any, hooks: tuple[str, ...], id: str = IMPL, gpu: bool = False) -> Any:
    """A bench case of the adapters' implementation (``values`` default to ``"adapters"``); ``gpu``
    marks it GPU-only."""
    marks = row_marks(IMPL, *hooks) + ([pytest.mark.gpu] if gpu else [])
    return pytest.param(*(values or (IMPL,)), marks=marks, id=id)


def unimplemented(path: str | Path, hooks: tuple[str, ...]) -> str | None:
    """Why a row needing ``hooks`` cannot run (its first hook with no implemented alternative), or None."""
    module = load_adapters(path)
    for alternatives in hooks:
        blanks = [blank_hook(module, h) for h in alternatives.split("|")]
        if all(b is not None for b in blanks):
            return blanks[0].skip_reason
    return None


# -- the training benches: DDP and the sharded optimizer through the hooks ---------------------------


def held_optimizers(optimizer: torch.optim.Optimizer) -> list[torch.optim.Optimizer]:
    """``optimizer`` and the optimizers it holds as attributes (directly or in a list / dict): where a
    sharded optimizer keeps its state, whatever it calls the wrapped instance."""
    found = [optimizer]
    for value in vars(optimizer).values():
        if isinstance(value, dict):
            values = list(value.values())
        else:
            values = list(value) if isinstance(value, list | tuple) else [value]
        found += [v for v in values if isinstance(v, torch.optim.Optimizer) and v is not optimizer]
    return found


def _first_implemented(module: types.ModuleType, *hooks: str) -> str:
    for hook in hooks:
        if blank_hook(module, hook) is None:
            return hook
    raise HookNotImplemented(" / ".join(hooks), "not implemented")


class AdaptersDDP(torch.nn.Module):
    """The adapters' DDP behind the interface the training harness drives (``forward``,
    ``on_train_batch_start()``, ``finish_gradient_synchronization()``): bucketed
    (``get_ddp_bucketed``) when ``bucket_mb`` is given, else per-parameter (1.0.5's
    ``get_ddp_individual_parameters``, or 2026's ``get_ddp``). Set ``optimizer`` before the first
    step: the hooks receive it."""

    def __init__(self, path: str | Path, module: torch.nn.Module, bucket_mb: float | None = None):
        super().__init__()
        self.hooks = load_adapters(path)
        if bucket_mb is not None:
            self.inner = call_hook(self.hooks, "get_ddp_bucketed", module, bucket_mb)
            self._after, self._start = "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"
        else:
            get = _first_implemented(self.hooks, "get_ddp_individual_parameters", "get_ddp")
            self.inner = call_hook(self.hooks, get, module)
            self._start = None
            self._after = (
                "ddp_individual_parameters_on_after_backward" if get != "get_ddp" else "ddp_on_after_backward"
            )
        self.optimizer: torch.optim.Optimizer | None = None

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.inner(*args, **kwargs)

    def on_train_batch_start(self) -> None:
        if self._start is not None:
            call_hook(self.hooks, self._start, self.inner, self.optimizer)

    def finish_gradient_synchronization(self) -> None:
        call_hook(self.hooks, self._after, self.inner, self.optimizer)


def sharded_optimizer(
    path: str | Path, params: Any, optimizer_cls: type, **kwargs: Any
) -> torch.optim.Optimizer:
    return call_hook(load_adapters(path), "get_sharded_optimizer", params, optimizer_cls, **kwargs)


# -- the contract run's summary -----------------------------------------------------------------------

SUMMARY_PLUGIN = "cs336-contract-summary"
HOOKS_PROPERTY = "contract_hooks"  # user property naming a contract test's hooks (it travels with reports)
_OUTCOMES = ("passed", "failed", "skipped")


class HookSummary:
    """Counts outcomes per hook from the test reports, and prints one line per hook at the end."""

    def __init__(self) -> None:
        self.counts: dict[str, Counter] = defaultdict(Counter)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        hooks = dict(report.user_properties).get(HOOKS_PROPERTY)
        # one count per test: its call phase, or the setup / teardown phase that failed or skipped
        if hooks is None or (report.when != "call" and report.outcome == "passed"):
            return
        for hook in hooks:
            self.counts[hook][report.outcome] += 1

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.counts:
            return
        terminalreporter.write_sep("=", "contract summary per hook")
        width = max(map(len, self.counts))
        for hook in sorted(self.counts):
            c = self.counts[hook]
            verdict = "FAIL" if c["failed"] else ("ok" if c["passed"] else "not implemented / skipped")
            cells = "  ".join(f"{c[o]:3d} {o}" for o in _OUTCOMES)
            terminalreporter.write_line(f"{hook:<{width}}  {cells}  {verdict}")
