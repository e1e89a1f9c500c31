"""What a worker says about a call that raised, as plain data for the judge: the exception's first
line, the frame of the student's code that called in (a failure deep inside torch or Triton names the
line of theirs that led there), the innermost frame, and whether it was a missing dependency."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

STUDENT_PACKAGES = ("cs336_systems", "cs336_basics", "tests")


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0][:500]}" if text else type(exc).__name__


def _inside(file: str, roots: list[str]) -> bool:
    try:
        path = Path(file).resolve()
    except OSError:
        return False
    return any(path.is_relative_to(Path(r).resolve()) for r in roots) and "site-packages" not in path.parts


def describe(exc: BaseException, roots: list[str]) -> dict[str, Any]:
    frames = traceback.extract_tb(exc.__traceback__)
    theirs = [f for f in frames if _inside(f.filename, roots)]
    where = lambda f: f"{f.filename}:{f.lineno}" if f else ""
    top = (getattr(exc, "name", None) or "").split(".")[0]
    missing = isinstance(exc, ModuleNotFoundError) and top and top not in STUDENT_PACKAGES
    return {
        "message": first_line(exc),
        "text": str(exc)[:4000],
        "student_frame": where(theirs[-1] if theirs else None),
        "innermost_frame": where(frames[-1] if frames else None),
        "missing_dependency": top if missing else None,
        "missing_module": (getattr(exc, "name", None) or "")
        if isinstance(exc, ModuleNotFoundError)
        else None,
    }
