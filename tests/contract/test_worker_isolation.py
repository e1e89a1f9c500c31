"""The boundary in code: the worker modules run beside a student's ``cs336_systems`` and may import the
standard library, torch, triton and each other (relatively), never the suite's package by name; the one
table of cases imports nothing but the standard library (both sides read it); the judging process never
imports a graded implementation; and no verdict is computed on the graded side (no worker module
imports the judge or names a verdict)."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from cs336_systems.grading import worker

WORKER = Path(worker.__file__).resolve().parent
ALLOWED = {"torch", "triton", "numpy", "__future__"} | set(sys.stdlib_module_names)


def _imports(module: str) -> list[tuple[str, int]]:
    names = []
    for node in ast.walk(ast.parse((WORKER / module).read_text())):
        if isinstance(node, ast.Import):
            names += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append((node.module or "", node.level))
    return names


@pytest.mark.parametrize("module", sorted(p.name for p in WORKER.glob("*.py")))
def test_worker_module_imports_no_suite_code(module: str) -> None:
    for name, level in _imports(module):
        top = name.split(".")[0]
        if level:
            assert top not in ("judge", "verdict", "summary", "session", "exchange"), (
                f"{module} reaches the judge ({name}): the graded side only computes"
            )
            continue
        student = top == "cs336_basics" and module == "fsdp.py"  # the student's own layers, on purpose
        assert top in ALLOWED or student, (
            f"{module} imports {name}: a worker reaches the suite only relatively"
        )


def test_the_table_of_cases_imports_only_the_standard_library() -> None:
    assert all(
        level == 0 and name.split(".")[0] in sys.stdlib_module_names | {"__future__"}
        for name, level in _imports("cases.py")
    )


def test_collecting_process_holds_no_graded_code(roots) -> None:
    graded = [
        str(p) for p in (roots.package_root, roots.basics_root) if p is not None and not roots.self_grade
    ]
    leaked = [
        m
        for m, mod in list(sys.modules.items())
        if any(str(getattr(mod, "__file__", "") or "").startswith(g) for g in graded)
    ]
    assert not leaked, f"the pytest process imported graded modules: {leaked[:5]}"
