"""Calling an adapters file's hooks: which count as not implemented, and the guard that refuses to
grade code of the suite's own tree as the student's.

A hook the file does not define, or one that raises ``NotImplementedError`` itself (the course's blank
template), is *not implemented*: its checks skip by name. A ``NotImplementedError`` raised deeper,
inside the student's code, is a real error and fails the check.
"""

from __future__ import annotations

import ast
import inspect
import textwrap
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from . import outcome


class HookNotImplemented(Exception):
    """The adapters file lacks ``hook`` or the hook raises ``NotImplementedError`` itself."""

    def __init__(self, hook: str, why: str):
        super().__init__(f"hook {hook} {why}")
        self.hook = hook

    @property
    def skip_reason(self) -> str:
        return f"{self.hook}: not implemented ({self.args[0]})"


class SuiteCodeGraded(BaseException):
    """A hook handed back code from the grading suite's own package: reporting it would grade the
    suite as the student (the shadowing this package exists to prevent). A BaseException, so that no
    check's ``except Exception`` turns the refusal into an ordinary failed case: it ends the worker."""


def _raised_by_hook(exc: BaseException, fn: Callable) -> bool:
    """Whether ``exc`` was raised in ``fn``'s own body (its last traceback frame is ``fn``'s code)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb is not None and tb.tb_frame.f_code is getattr(fn, "__code__", None)


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


def defining_file(obj: Any) -> str | None:
    """The source file of ``obj``'s class (or of ``obj`` itself when it is a class or function)."""
    target = obj if inspect.isclass(obj) or inspect.isroutine(obj) else type(obj)
    try:
        return inspect.getfile(target)
    except (TypeError, OSError):
        return None


class Hooks:
    """The hooks of one loaded adapters file. ``hooks.name(*args)`` calls a hook; when ``forbidden`` (the
    suite's own package folder) is set, whatever a hook returns must not come from a file inside it."""

    def __init__(self, module: types.ModuleType, forbidden: str | None):
        self.module = module
        self.forbidden = Path(forbidden).resolve() if forbidden else None

    def __getattr__(self, hook: str) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            return self.check_origin(hook, call_hook(self.module, hook, *args, **kwargs))

        return call

    def check_origin(self, hook: str, obj: Any) -> Any:
        file = defining_file(obj)
        if self.forbidden is not None and file and Path(file).resolve().is_relative_to(self.forbidden):
            raise SuiteCodeGraded(
                f"refusing to grade: hook {hook} returned {getattr(obj, '__qualname__', type(obj).__qualname__)} "
                f"from {file}, inside the grading suite's own package ({self.forbidden}), not the student's"
            )
        return obj


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


EDITIONS = {
    "1.0.5": (
        "get_flashattention_autograd_function_pytorch",
        "get_flashattention_autograd_function_triton",
        "get_ddp_individual_parameters",
        "ddp_individual_parameters_on_after_backward",
        "get_ddp_bucketed",
        "ddp_bucketed_on_after_backward",
        "ddp_bucketed_on_train_batch_start",
        "get_sharded_optimizer",
    ),
    "26.1": (
        "get_flashattention_autograd_function_pytorch",
        "get_flashattention_autograd_function_triton",
        "get_ddp",
        "ddp_on_after_backward",
        "get_sharded_optimizer",
        "get_fsdp",
        "fsdp_on_after_backward",
        "fsdp_gather_full_params",
    ),
}
ALL_HOOKS = tuple(dict.fromkeys(h for hooks in EDITIONS.values() for h in hooks))


def probe(module: types.ModuleType) -> dict:
    """Which hooks the file defines, and why each blank one is not implemented (read from source)."""
    blank = {h: (b.skip_reason if (b := blank_hook(module, h)) else None) for h in ALL_HOOKS}
    defined = [h for h in ALL_HOOKS if getattr(module, h, None) is not None]
    return {"blank": blank, "defined": defined}


def run_cases(train: Callable[[Hooks, dict], list[str]], hooks: Hooks, table: dict, ids: list[str]) -> dict:
    """Each case's verdict: ``train(hooks, case)``'s list of misses (none: passed); a blank hook skips
    it; any other exception fails it, naming where it was raised."""
    verdicts = {}
    for cid in ids:
        try:
            verdicts[cid] = outcome.from_misses(train(hooks, table[cid]))
        except HookNotImplemented as exc:
            verdicts[cid] = outcome.skipped(exc.skip_reason)
        except Exception as exc:
            verdicts[cid] = outcome.describe(exc)
    return verdicts
