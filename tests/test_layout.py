"""The package layout as a contract (issue 13): the library never imports pytest, the harness, the
report or the CLI; the model, attention and kernels never import profiling either; only ``harness/``
knows pytest. Read from the source (no imports executed), so a violation anywhere fails here."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src" / "cs336_systems"
LIBRARY = ("model", "attention", "kernels", "distributed", "profiling", "accounting", "nvtx.py", "units.py")
ABOVE_LIBRARY = ("cs336_systems.harness", "cs336_systems.report", "cs336_systems.cli")
CORE = ("model", "attention", "kernels", "nvtx.py")  # below profiling too


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _modules(part: str) -> list[Path]:
    root = SRC / part
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


def _violations(parts: tuple[str, ...], forbidden: tuple[str, ...]) -> list[str]:
    return [
        f"{path.relative_to(SRC)} imports {name}"
        for part in parts
        for path in _modules(part)
        for name in sorted(_imports(path))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_only_the_harness_imports_pytest() -> None:
    users = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.relative_to(SRC).parts[0] != "harness" and {"pytest", "pytest_benchmark"} & _imports(p)
    ]
    assert not users, f"pytest outside harness/: {users}"


@pytest.mark.parametrize(
    "parts, forbidden",
    [(LIBRARY, ABOVE_LIBRARY), (CORE, ("cs336_systems.profiling",))],
    ids=["library-below-harness-report-cli", "core-below-profiling"],
)
def test_imports_never_run_upwards(parts: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    assert not _violations(parts, forbidden)


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("import pytest\nfrom cs336_systems.harness.record import record_oom\n")
    assert {"pytest", "cs336_systems.harness.record"} <= _imports(bad)
