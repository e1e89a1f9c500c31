"""The package layout as a contract (issues 13 and 36), read from the source (no imports executed), so a
violation anywhere fails here:

- layers: the library never imports ``training/``, ``rows/``, the harness, the report or the CLI;
  ``training/`` (which composes the library into a step) never imports ``rows/``, the harness, the report
  or the CLI; the model, attention and kernels never import profiling either; only ``harness/`` knows
  pytest;
- floors inside the library: the model imports attention and the kernels, attention the kernels, so the
  kernels import neither and attention not the model; the leaf modules (``nvtx.py``, ``units.py``,
  ``adamw_base.py``) import nothing of the package;
- the harness (which writes rows) and the report (which reads them) never import each other: what both
  need, the group contract and the verdict on a row's timing, is ``rows/``, which imports nothing else of
  the package;
- ``jobs/`` (the executor both the sweep and the class run use) imports nothing else of the package, and
  the grader never imports the harness (the harness may import the grader);
- no import cycle among the modules of ``src/``, function-local imports included;
- ``grading/`` is laid out by process (``tests/test_layout_grading.py``, with these helpers);
- no file under ``src/cs336_systems/`` over 500 lines;
- ``CS336_*`` environment variables read only in settings modules, spelled out or through a constant;
- ``scripts/`` holds user tools only: at most 400 lines in all, no probes.

Each check is a function over a tree, so the ``*_sees_*`` tests can show it a broken tree of their own.
"""

from __future__ import annotations

import ast
from collections import deque
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SRC_ROOT = REPO / "src"
SRC = SRC_ROOT / "cs336_systems"
LEAVES = ("nvtx.py", "units.py", "adamw_base.py")  # import nothing of the package
LIBRARY = ("model", "attention", "kernels", "distributed", "profiling", "accounting", *LEAVES)
TRAINING = ("training",)  # composes the library; the harness and the CLI import it, the library does not
ROWS = ("rows",)  # what a bench row is (its group, its verdict): below the harness and the report
JOBS = ("jobs",)  # calls run as jobs (submitit): the sweep and the class run share it, importing neither
ABOVE = ("harness", "grading", "report", "cli")  # grading: the harness of another implementation
ABOVE_TRAINING = tuple(f"cs336_systems.{part}" for part in (*ROWS, *JOBS, *ABOVE))
ABOVE_LIBRARY = ("cs336_systems.training", *ABOVE_TRAINING)
CORE = ("model", "attention", "kernels", "nvtx.py")  # below profiling too
PACKAGE = ("cs336_systems",)
OUTSIDE_ROWS = tuple(f"cs336_systems.{p.removesuffix('.py')}" for p in (*LIBRARY, *TRAINING, *JOBS, *ABOVE))
OUTSIDE_JOBS = tuple(f"cs336_systems.{p.removesuffix('.py')}" for p in (*LIBRARY, *TRAINING, *ROWS, *ABOVE))

# (parts, the imports they must not make, id). The last three ids are edges that once ran up the floors:
# kernels/fused_adamw.py -> model/optim.py (the AdamW base class, now adamw_base.py), and
# harness/distributed.py -> report/schema.py with report/load.py -> harness/contention.py (both now rows/).
LAYER_RULES = [
    (LIBRARY, ABOVE_LIBRARY, "library-below-training-rows-harness-report-cli"),
    (TRAINING, ABOVE_TRAINING, "training-below-rows-harness-report-cli"),
    (CORE, ("cs336_systems.profiling",), "core-below-profiling"),
    (("attention",), ("cs336_systems.model",), "attention-below-model"),
    (LEAVES, PACKAGE, "leaves-import-nothing-of-the-package"),
    (ROWS, OUTSIDE_ROWS, "rows-import-only-rows"),
    (JOBS, OUTSIDE_JOBS, "jobs-import-only-jobs"),
    (("grading",), ("cs336_systems.harness",), "grading-never-imports-harness"),
    (("kernels",), ("cs336_systems.model", "cs336_systems.attention"), "kernels-below-model-and-attention"),
    (("harness",), ("cs336_systems.report",), "harness-never-imports-report"),
    (("report",), ("cs336_systems.harness",), "report-never-imports-harness"),
]

MAX_LINES = 500
MAX_SCRIPT_LINES = 400
ENV_PREFIX = "CS336_"


@cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _module_of(path: Path, root: Path) -> str:
    """``root/a/b.py`` -> ``a.b``; a package's ``__init__.py`` is the package."""
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, root: Path = SRC_ROOT) -> set[str]:
    """The absolute names every import statement of ``path`` names, at any depth (function-local too):
    ``import a.b`` -> ``a.b``; ``from a import b`` -> ``a.b`` (a submodule of ``a`` or a name in it);
    relative imports are resolved against the package of ``path`` under ``root``."""
    names = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                module = _module_of(path, root)
                package = module if path.name == "__init__.py" else module.rpartition(".")[0]
                anchor = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                base = f"{anchor}.{base}" if base else anchor
            names.update(base if alias.name == "*" else f"{base}.{alias.name}" for alias in node.names)
    return names


def _modules(part: str, src: Path = SRC) -> list[Path]:
    root = src / part
    return [root] if root.suffix == ".py" else sorted(root.rglob("*.py"))


def _violations(parts: tuple[str, ...], forbidden: tuple[str, ...], src: Path = SRC) -> list[str]:
    """``path imports name`` for every import of a module of ``parts`` (under the package ``src``) that
    names one of ``forbidden`` or something inside it."""
    return [
        f"{path.relative_to(src)} imports {name}"
        for part in parts
        for path in _modules(part, src)
        for name in sorted(_imports(path, src.parent))
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    ]


def test_only_the_harness_imports_pytest() -> None:
    users = [
        str(p.relative_to(SRC))
        for p in SRC.rglob("*.py")
        if p.relative_to(SRC).parts[0] not in ("harness", "grading")
        and "worker" not in p.relative_to(SRC).parts
        and {"pytest", "pytest_benchmark"} & {name.partition(".")[0] for name in _imports(p)}
    ]
    assert not users, f"pytest outside harness/ and grading/: {users}"


@pytest.mark.parametrize(
    "parts, forbidden", [rule[:2] for rule in LAYER_RULES], ids=[rule[2] for rule in LAYER_RULES]
)
def test_imports_never_run_upwards(parts: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    violations = _violations(parts, forbidden)
    assert not violations, violations


def test_every_package_has_a_layer() -> None:
    """A new top-level package or module must take a place in the layers above, or nothing checks it."""
    present = {p.name for p in SRC.iterdir() if p.name not in ("__init__.py", "__pycache__")}
    assert present == {*LIBRARY, *TRAINING, *ROWS, *JOBS, *ABOVE}


@pytest.mark.parametrize(
    "path, line",
    [
        ("kernels/fused_adamw.py", "from cs336_systems.model.optim import AdamW"),
        ("harness/distributed.py", "from cs336_systems.report.schema import tag"),
        ("report/load.py", "def f():\n    from ..harness import contention"),
    ],
    ids=["kernels-model", "harness-report", "report-harness"],
)
def test_the_layer_rules_see_the_edges_that_ran_upwards(tmp_path: Path, path: str, line: str) -> None:
    # The three edges of issue 57, planted in a copy of the package's tree one at a time (the last one
    # function-local and relative): the rules flag the planted module, and only it.
    src = tmp_path / "cs336_systems"
    for part in (*LIBRARY, *TRAINING, *ROWS, *JOBS, *ABOVE):
        (src / part).parent.mkdir(parents=True, exist_ok=True)
        if part.endswith(".py"):
            (src / part).write_text("")
        else:
            (src / part).mkdir()
            (src / part / "__init__.py").write_text("")
    (src / path).write_text(line + "\n")
    flagged = {
        v.split()[0] for parts, forbidden, _ in LAYER_RULES for v in _violations(parts, forbidden, src)
    }
    assert flagged == {path}


def test_the_check_sees_a_violation(tmp_path: Path) -> None:
    bad = tmp_path / "pkg" / "bad.py"
    bad.parent.mkdir()
    bad.write_text(
        "import pytest\nfrom cs336_systems.harness.record import record_oom\n"
        "def f():\n    from cs336_systems import training\n    from . import sibling\n"
    )
    assert {"pytest", "cs336_systems.harness.record.record_oom", "cs336_systems.training", "pkg.sibling"} == (
        _imports(bad, tmp_path)
    )


# ----------------------------------------------------------------------------------- import cycles


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of ``package`` it imports (a name resolves to its longest module prefix:
    ``from a import f`` is an edge to ``a``, ``from a import sub`` one to ``a.sub``). Importing
    ``a.b`` also runs ``a/__init__.py``; those implicit edges are left out, or every package whose
    ``__init__`` re-exports a submodule would be a cycle."""
    files = {_module_of(p, root): p for p in sorted((root / package).rglob("*.py"))}

    def resolve(name: str) -> str | None:
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for module, path in files.items():
        targets = {resolve(name) for name in _imports(path, root)}
        graph[module] = {t for t in targets if t is not None and t != module}
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


def _shortest_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A shortest cycle through the component's first module, as ``[a, b, ..., a]``."""
    start = min(component)
    parent = {start: start}
    queue = deque([start])
    while queue:
        module = queue.popleft()
        for target in sorted(graph[module] & component):
            if target == start:
                path = [module]
                while path[-1] != start:
                    path.append(parent[path[-1]])
                return [*reversed(path), start]
            if target not in parent:
                parent[target] = module
                queue.append(target)
    raise AssertionError(f"{sorted(component)} is not strongly connected")


def _cycles(graph: dict[str, set[str]]) -> list[str]:
    """One line per strongly connected component of more than one module: a cycle through it."""
    reach = {module: _reachable(graph, module) for module in graph}
    components = {
        frozenset(other for other in reach[module] if module in reach[other])
        for module in graph
        if module in reach[module]
    }
    return sorted(
        " -> ".join(_shortest_cycle(graph, c)) + (f" (component of {len(c)} modules)" if len(c) > 2 else "")
        for c in components
    )


def test_no_import_cycle() -> None:
    cycles = _cycles(_import_graph(SRC_ROOT, "cs336_systems"))
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_the_cycle_check_sees_a_function_local_cycle(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("from pkg.a import f\n")  # a re-export: no cycle by itself
    (pkg / "a.py").write_text("from pkg.sub import b\ndef f():\n    pass\n")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "sub" / "b.py").write_text("def g():\n    from .. import a\n")
    (pkg / "c.py").write_text("from pkg import f\nimport pkg.sub.b\n")
    graph = _import_graph(tmp_path, "pkg")
    assert graph["pkg"] == {"pkg.a"} and graph["pkg.sub.b"] == {"pkg.a"}
    assert graph["pkg.c"] == {"pkg", "pkg.sub.b"}  # a name from a package's __init__ is an edge to it
    assert _cycles(graph) == ["pkg.a -> pkg.sub.b -> pkg.a"]


# ------------------------------------------------------------------------------------ file lengths


def _line_count(path: Path) -> int:
    return len(path.read_text().splitlines())


def _long_files(root: Path, limit: int) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*.py") if _line_count(p) > limit}


def test_no_library_file_over_500_lines() -> None:
    long = _long_files(SRC, MAX_LINES)
    assert not long, f"over {MAX_LINES} lines: {sorted(long)}"


def test_the_length_check_sees_a_long_file(tmp_path: Path) -> None:
    (tmp_path / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "long.py").write_text("x = 1\n" * (MAX_LINES + 1))
    assert _long_files(tmp_path, MAX_LINES) == {"long.py"}


# -------------------------------------------------------------------------------- CS336_* variables


def _env_key(node: ast.expr) -> str | None:
    """The variable name (or its literal head, for an f-string) if ``node`` spells a CS336_* name."""
    if isinstance(node, ast.JoinedStr) and node.values:
        node = node.values[0]
    if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith(ENV_PREFIX):
        return node.value
    return None


def _env_constants(*roots: Path) -> dict[str, str]:
    """Names bound to a ``CS336_*`` string anywhere under ``roots`` (``SEED_ENV = "CS336_GRADE_SEED"``):
    a read through one, imported or not, is a read of that variable."""
    constants = {}
    for path in (p for root in roots for p in sorted(root.rglob("*.py"))):
        for node in ast.walk(_tree(path)):
            single = isinstance(node, ast.Assign) and len(node.targets) == 1
            if single and isinstance(node.targets[0], ast.Name) and (name := _env_key(node.value)):
                constants[node.targets[0].id] = name
    return constants


def _env_reads(path: Path, constants: dict[str, str] | None = None) -> list[str]:
    """``CS336_*`` keys read at any depth: ``m[key]``, ``m.get/pop/setdefault(key)``, ``getenv(key)``
    and ``key in m``, whatever the mapping is called (an alias of ``os.environ`` reads it too), the key
    spelled out or a name of ``constants`` (``os.environ.get(NCU_ENV)``, ``settings.NCU_ENV``).
    Writes (``os.environ[key] = ...``, ``monkeypatch.setenv``, a ``pop`` whose value is dropped) and
    docstrings are not reads."""
    constants = constants or {}
    dropped = {id(n.value) for n in ast.walk(_tree(path)) if isinstance(n, ast.Expr)}
    keys = []
    for node in ast.walk(_tree(path)):
        key = None
        if isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load):
            key = node.slice
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            getter = name == "getenv" or (
                isinstance(func, ast.Attribute) and name in ("get", "pop", "setdefault")
            )
            key = node.args[0] if getter and not (name == "pop" and id(node) in dropped) else None
        elif isinstance(node, ast.Compare) and isinstance(node.ops[0], ast.In | ast.NotIn):
            key = node.left
        if isinstance(key, ast.Name | ast.Attribute):
            key = ast.Constant(constants.get(key.id if isinstance(key, ast.Name) else key.attr))
        if key is not None and (name := _env_key(key)):
            keys.append((node.lineno, name))
    return [f"{path.name}:{line} {name}" for line, name in sorted(keys)]


def _env_readers(root: Path) -> dict[str, list[str]]:
    """Files under ``root`` outside settings modules (any ``settings.py``) that read CS336_* variables."""
    constants = _env_constants(root, SRC)
    found = {
        str(p.relative_to(root)): _env_reads(p, constants)
        for p in sorted(root.rglob("*.py"))
        if p.name != "settings.py"
    }
    return {path: keys for path, keys in found.items() if keys}


@pytest.mark.parametrize(
    "tree, known",
    [("src/cs336_systems", set()), ("bench", set()), ("scripts", set()), ("tests", set())],
)
def test_cs336_variables_are_read_only_in_settings_modules(tree: str, known: set[str]) -> None:
    readers = _env_readers(REPO / tree)
    assert set(readers) <= known, (
        f"CS336_* read outside settings.py: { {p: readers[p] for p in set(readers) - known} }"
    )
    assert known <= set(readers), (
        f"no longer reads CS336_*, drop it from the known readers: {sorted(known - set(readers))}"
    )


def test_the_env_check_sees_reads(tmp_path: Path) -> None:
    (tmp_path / "lib.py").write_text(
        '"""Reads CS336_DOC (a docstring is no read)."""\nimport os\nfrom os import environ, getenv\n'
        'os.environ["CS336_WRITE"] = "1"\nA = os.environ["CS336_A"]\n'
        'def f(name):\n    env = os.environ\n    return env.get(f"CS336_{name}"), getenv("CS336_C")\n'
        'B = "CS336_B" in environ\nD = os.getenv("HOME")\n'
        "from settings import E_ENV\nE = os.environ.get(E_ENV)\nos.environ.pop(E_ENV, None)\n"
    )
    (tmp_path / "settings.py").write_text('import os\nE_ENV = "CS336_E"\nX = os.environ.get("CS336_X")\n')
    assert _env_readers(tmp_path) == {
        "lib.py": [
            "lib.py:5 CS336_A",
            "lib.py:8 CS336_",
            "lib.py:8 CS336_C",
            "lib.py:9 CS336_B",
            "lib.py:12 CS336_E",
        ]
    }


# ------------------------------------------------------------------------------------------ scripts


def _script_problems(scripts: Path) -> list[str]:
    files = sorted(p for p in scripts.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    problems = [
        f"{p.relative_to(scripts)} is a probe (flash_*, *_diag, *_probe): a bench case, a CLI command or gone"
        for p in files
        if p.name.startswith("flash_") or p.stem.endswith(("_diag", "_probe"))
    ]
    total = sum(_line_count(p) for p in files)
    if total > MAX_SCRIPT_LINES:
        problems.append(f"scripts/ holds {total} lines, more than {MAX_SCRIPT_LINES}")
    return problems


def test_scripts_are_user_tools() -> None:
    problems = _script_problems(REPO / "scripts")
    assert not problems, "\n".join(problems)


def test_the_scripts_check_sees_probes(tmp_path: Path) -> None:
    (tmp_path / "ddp_train.py").write_text("x = 1\n" * MAX_SCRIPT_LINES)
    assert _script_problems(tmp_path) == []
    for name in ("flash_table.py", "model_attention_diag.py", "ws_probe.sh"):
        (tmp_path / name).write_text("")
    (tmp_path / "run.sh").write_text("echo\n")
    problems = _script_problems(tmp_path)
    assert [p.split()[0] for p in problems[:-1]] == [
        "flash_table.py",
        "model_attention_diag.py",
        "ws_probe.sh",
    ]
    assert problems[-1] == f"scripts/ holds {MAX_SCRIPT_LINES + 1} lines, more than {MAX_SCRIPT_LINES}"
