"""Calling an adapters file's hooks in a worker, with the guard that refuses to grade code of the suite's
own tree as the student's. Which hooks are blank (not implemented) is decided by the judging process
from the file's source (``grading/probe.py``), never from what a call here raises."""

from __future__ import annotations

import inspect
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any


class SuiteCodeGraded(BaseException):
    """A hook handed back code from the grading suite's own package: reporting it would grade the
    suite as the student (the shadowing this package exists to prevent). A BaseException, so that no
    ``except Exception`` turns the refusal into an ordinary failed case: it ends the worker."""


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
        fn = getattr(self.module, hook, None)
        if fn is None:
            raise AttributeError(f"the adapters file defines no hook {hook}")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.check_origin(hook, fn(*args, **kwargs))

        return call

    def check_origin(self, hook: str, obj: Any) -> Any:
        file = defining_file(obj)
        if self.forbidden is not None and file and Path(file).resolve().is_relative_to(self.forbidden):
            raise SuiteCodeGraded(
                f"refusing to grade: hook {hook} returned {getattr(obj, '__qualname__', type(obj).__qualname__)} "
                f"from {file}, inside the grading suite's own package ({self.forbidden}), not the student's"
            )
        return obj
