"""The worker modules run beside a student's ``cs336_systems``: they may import the standard library,
torch, triton and each other (relatively), never the suite's package by name. And the pytest process
never imports a graded implementation: it holds no module from a graded repository."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

from cs336_systems.grading import worker

WORKER = Path(worker.__file__).resolve().parent
ALLOWED = {"torch", "triton", "numpy", "__future__"} | set(sys.stdlib_module_names)


@pytest.mark.parametrize("module", sorted(p.name for p in WORKER.glob("*.py")))
def test_worker_module_imports_no_suite_code(module: str) -> None:
    tree = ast.parse((WORKER / module).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            student = top in ("cs336_basics",) and module == "fsdp.py"  # the student's own layers, on purpose
            assert top in ALLOWED or student, (
                f"{module} imports {name}: a worker reaches the suite only relatively"
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
