"""The boundary in code: the modules a worker loads beside a student's ``cs336_systems`` (``worker/``, and
``shared/``, which the judge loads too) may import the standard library, torch, triton and each other
(relatively: a worker module its siblings and ``..shared``, a shared module its siblings), never the
suite's package by name; the one table of cases imports nothing but the standard library; outside
``worker/`` nothing of the suite imports a worker module (the runner starts them by file); the judging
process never imports a graded implementation; and no verdict is computed on the graded side (no module
a worker loads can reach the judge)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems import grading

GRADING = Path(grading.__file__).resolve().parent
WORKER, SHARED = GRADING / "worker", GRADING / "shared"
SRC = GRADING.parents[1]
ALLOWED = {"torch", "triton", "numpy", "__future__"} | set(sys.stdlib_module_names)


def _imports(path: Path) -> list[tuple[str, int]]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [(a.name, 0) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append((node.module or "", node.level))
    return names


def _check_relative(path: Path, name: str, level: int) -> None:
    """A worker module reaches its siblings (level 1) and ``..shared`` (level 2); a shared module only
    its siblings: in a worker the two are ``_cs336_grader.worker`` and ``.shared``, and nothing else."""
    if path.parent == WORKER and level == 2:
        assert name.split(".")[0] == "shared", (
            f"{path.name} reaches {name} (level 2): only ..shared is loaded"
        )
    else:
        assert level == 1, (
            f"{path.parent.name}/{path.name} reaches {'.' * level}{name}: not loaded in a worker"
        )


@pytest.mark.parametrize(
    "path", sorted([*WORKER.glob("*.py"), *SHARED.glob("*.py")]), ids=lambda p: f"{p.parent.name}/{p.name}"
)
def test_modules_a_worker_loads_import_no_suite_code(path: Path) -> None:
    for name, level in _imports(path):
        if level:
            _check_relative(path, name, level)
            continue
        top = name.split(".")[0]
        student = top == "cs336_basics" and path == WORKER / "fsdp.py"  # the student's own layers, on purpose
        assert top in ALLOWED or student, (
            f"{path.name} imports {name}: a worker reaches the suite only relatively"
        )


def test_the_table_of_cases_imports_only_the_standard_library() -> None:
    assert all(
        level == 0 and name.split(".")[0] in sys.stdlib_module_names | {"__future__"}
        for name, level in _imports(SHARED / "cases.py")
    )


def _absolute(path: Path, name: str, level: int) -> str:
    """The dotted name an import in ``path`` (a module of ``src/``) reaches."""
    if not level:
        return name
    package = list(path.relative_to(SRC).parent.parts)
    return ".".join([*package[: len(package) - level + 1], *([name] if name else [])])


def test_nothing_outside_the_worker_imports_it() -> None:
    """The judge, the harness and the CLIs share with the worker only through ``shared/``; the runner
    starts ``worker/__main__.py`` by its path, importing nothing of it."""
    found = [
        f"{path.relative_to(SRC)}: {target}"
        for path in sorted(SRC.rglob("*.py"))
        if not path.is_relative_to(WORKER)
        for name, level in _imports(path)
        if (target := _absolute(path, name, level)).startswith("cs336_systems.grading.worker")
    ]
    assert not found, f"imports of the worker outside it: {found}"


# In a process where ``cs336_systems`` cannot be imported, as in a worker: every module of both folders
# loads through the private packages, and the judge is out of reach.
_PRIVATE = """
import importlib, importlib.util, sys
sys.modules["cs336_systems"] = None
spec = importlib.util.spec_from_file_location("worker_main", sys.argv[1])
main = importlib.util.module_from_spec(spec)
spec.loader.exec_module(main)
main._install_packages()
for name in sys.argv[2:]:
    importlib.import_module(main.PACKAGE + "." + name)
try:
    importlib.import_module(main.PACKAGE + ".judge")
except ImportError:
    print("judge out of reach")
"""


def test_every_module_a_worker_loads_imports_in_the_private_packages() -> None:
    names = [
        f"{folder.name}.{p.stem}"
        for folder in (WORKER, SHARED)
        for p in sorted(folder.glob("*.py"))
        if p.stem not in ("__init__", "__main__")
    ]
    cmd = [sys.executable, "-c", _PRIVATE, str(WORKER / "__main__.py"), *names]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd="/")
    assert run.returncode == 0 and run.stdout.strip() == "judge out of reach", run.stdout + run.stderr


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
