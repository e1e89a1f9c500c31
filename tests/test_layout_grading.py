"""``src/cs336_systems/grading/`` laid out by process, read from the source like ``test_layout.py``:

- a folder per process of a class, top down: ``class_run/`` (the class's parent, ``cli.grade``), ``repo/``
  (one repository's job), ``judge/`` (the judging process); ``worker/`` (beside the graded code, the only
  place it runs) and ``shared/`` (what both sides load); what two processes or more load sits at
  ``grading/``'s top, and a top-level module that one process alone imports belongs in its folder;
- each folder imports only its own floor and those below it (the top level: only itself and ``shared/``;
  the worker: only ``shared/``), and the folders import one another in no cycle;
- nothing outside ``worker/`` imports it (the judge starts it by its file's path).

``test_layout.py`` holds the rest: ``grading`` never imports the harness, ``jobs/`` imports neither, and
every ``CS336_*`` read (constants included) is in a ``settings.py``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_layout import JOBS, OUTSIDE_JOBS, SRC, SRC_ROOT, _cycles, _import_graph, _violations

# The processes of a class, top down: cli.grade's class run starts a repository's job, which starts the
# judge, which starts the workers. A folder imports only its own floor and those FLOORS lists.
PROCESSES = ("class_run", "repo", "judge")
SIDES = ("worker", "shared")  # beside the graded code; what both sides load
# grading's top level: what two processes or more load, importing only itself and shared/.
COMMON = (
    *("access", "caches", "exchange", "gradescope", "gradescope_zip", "leaderboard_row", "mounts", "network"),
    *("limits", "probe", "progress", "roots", "sandbox", "settings", "verdict", "walls"),
)
FLOORS = {
    "class_run": {"class_run", "repo", "judge", "common", "shared"},
    "repo": {"repo", "judge", "common", "shared"},
    "judge": {"judge", "common", "shared"},
    "common": {"common", "shared"},
    "worker": {"worker", "shared"},
    "shared": {"shared"},
}
# Common modules that no two processes import, and why they are common anyway.
NOT_IMPORTED = {
    "mounts": "run by its path in each worker's namespace (sandbox.py)",
    "gradescope_zip": "the autograder zip's scripts: cli.autograder's, no process of a class",
}


def _floor(module: str) -> str | None:
    """``cs336_systems.grading.repo.leaderboard.row`` -> ``repo``; a top-level module -> ``common``;
    ``None`` outside ``grading/`` (and for the package itself)."""
    parts = module.split(".")
    if parts[:2] != ["cs336_systems", "grading"] or len(parts) < 3:
        return None
    return parts[2] if parts[2] in (*PROCESSES, *SIDES) else "common"


def _floor_violations(root: Path = SRC_ROOT) -> list[str]:
    graph = _import_graph(root, "cs336_systems")
    return [
        f"{module} ({floor}) imports {target} ({_floor(target)})"
        for module, targets in sorted(graph.items())
        if (floor := _floor(module))
        for target in sorted(targets)
        if _floor(target) not in (None, *FLOORS[floor])
    ]


def _worker_importers(root: Path = SRC_ROOT) -> list[str]:
    """Modules outside ``worker/`` that import it (a worker is started by its file's path, never imported)."""
    graph = _import_graph(root, "cs336_systems")
    return [
        f"{module} imports {target}"
        for module, targets in sorted(graph.items())
        if _floor(module) != "worker"
        for target in sorted(targets)
        if _floor(target) == "worker"
    ]


def _floor_cycles(root: Path = SRC_ROOT) -> list[str]:
    """The cycles among grading's folders (its top level as one): the module graph, one node a folder."""
    graph = _import_graph(root, "cs336_systems")
    folders: dict[str, set[str]] = {floor: set() for floor in FLOORS}
    for module, targets in graph.items():
        if floor := _floor(module):
            folders[floor] |= {t for target in targets if (t := _floor(target)) and t != floor}
    return _cycles(folders)


def _lone_commons(root: Path = SRC_ROOT) -> dict[str, list[str]]:
    """Top-level modules that fewer than two processes import (another common module counts as one,
    the CLI or the harness as one each): they belong in their one user's folder."""
    users: dict[str, set[str]] = {name: set() for name in COMMON}
    for module, targets in _import_graph(root, "cs336_systems").items():
        for target in targets:
            name = target.split(".")[2] if _floor(target) == "common" else None
            if name in users and module.split(".")[2:3] != [name]:
                users[name].add(_floor(module) or module.split(".")[1])
    return {n: sorted(u) for n, u in users.items() if len(u) < 2 and n not in NOT_IMPORTED}


def test_grading_folders_name_their_process() -> None:
    present = {p.name.removesuffix(".py") for p in (SRC / "grading").iterdir()}
    assert present - {"__init__", "__pycache__"} == {*PROCESSES, *SIDES, *COMMON}
    assert not _lone_commons(), f"imported by one process only (move it there): {_lone_commons()}"


def test_grading_imports_only_its_floors() -> None:
    assert not _floor_violations(), "\n".join(_floor_violations())


def test_nothing_outside_the_worker_imports_it() -> None:
    assert not _worker_importers(), "\n".join(_worker_importers())


def test_no_import_cycle_between_gradings_folders() -> None:
    assert not _floor_cycles(), "\n".join(_floor_cycles())


@pytest.mark.parametrize(
    "path, line, flagged",
    [
        ("grading/judge/c.py", "from .. import roots\nfrom ..repo import b", {"floors", "cycles"}),
        ("grading/sandbox.py", "def f():\n    from .class_run import a", {"floors", "cycles"}),
        ("harness/h.py", "from cs336_systems.grading.worker import w", {"worker"}),
        ("grading/judge/c.py", "from .. import roots\nfrom ..worker import w", {"floors", "worker"}),
        ("grading/judge/c.py", "from .. import roots\nimport cs336_systems.harness", {"harness"}),
        ("jobs/run.py", "from cs336_systems.grading import sandbox", {"jobs"}),
        ("grading/judge/c.py", "", {"lone"}),  # roots: the repository's job's alone
    ],
    ids=[
        "judge-repo",
        "common-class_run",
        "harness-worker",
        "judge-worker",
        "grading-harness",
        "jobs-grading",
        "lone",
    ],
)
def test_the_grading_rules_see_a_break(tmp_path: Path, path: str, line: str, flagged: set[str]) -> None:
    # A miniature package whose every rule holds (the class run imports the repository's job, which
    # imports the judge; two processes import roots and sandbox each), then one file rewritten.
    src = tmp_path / "cs336_systems"
    files = {
        "grading/class_run/a.py": "from ..repo import b\nfrom .. import sandbox",
        "grading/repo/b.py": "from ..judge import c\nfrom .. import roots, sandbox",
        "grading/judge/c.py": "from .. import roots",
        "grading/worker/w.py": "from ..shared import s",
        "grading/shared/s.py": "",
        "harness/h.py": "from cs336_systems.grading.judge import c",
        "jobs/run.py": "",
        **{f"grading/{name}.py": "" for name in COMMON},
    }
    files[path] = line
    for name, text in files.items():
        for folder in [*(src / name).relative_to(src).parents][:-1]:
            (src / folder).mkdir(parents=True, exist_ok=True)
            (src / folder / "__init__.py").touch()
        (src / name).write_text(text + "\n")
    (src / "__init__.py").touch()
    rules = {
        "floors": _floor_violations(tmp_path),
        "worker": _worker_importers(tmp_path),
        "cycles": _floor_cycles(tmp_path),
        "lone": [n for n in _lone_commons(tmp_path) if n in ("roots", "sandbox")],
        "harness": _violations(("grading",), ("cs336_systems.harness",), src),
        "jobs": _violations(JOBS, OUTSIDE_JOBS, src),
    }
    assert {rule for rule, found in rules.items() if found} == flagged


def test_no_measurement_dates_or_gpu_figures_in_the_source() -> None:
    """Figures and when they were measured live in docs/perf-notes.md and docs/grading.md, which a
    re-measurement updates; a docstring keeps only why (issue 72). The grader names no GPU model at all;
    the rest of the package only as data (peak rates, memory sizes)."""
    dated, named = [], []
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        dated += [path.name] if re.search(r"\b20\d\d-\d\d-\d\d\b", text) else []
        if "grading" in path.relative_to(SRC).parts:
            named += [path.name] if re.search(r"\bH[12]00\b", text) else []
    assert not dated and not named, {"dated": dated, "a GPU named in grading/": named}
