"""What the adapters file needs in order to load, read before any worker starts: its module-level
imports and, transitively, those of the student's own modules they reach (parsed with ``ast``; the
student's code is never imported here).

A module-level import is a statement that runs whenever its file is imported: one directly in the
file's body. Imports inside functions (the course's template imports its hooks lazily), inside ``if``
blocks (``if TYPE_CHECKING``, ``if __name__ == "__main__"``, a GPU-only branch) and inside ``try``
blocks (``except ImportError`` fallbacks) may never run, and are left to the worker's load.

A top-level name is looked up where the worker will look: first the student's roots (a package or
module there; ``cs336_systems`` and ``cs336_basics`` only there, never the grader's own package of the
same name), then the grading environment (``importlib.util.find_spec`` of the top-level name alone,
which imports nothing). A name found nowhere is a dependency the grading environment lacks when the
repository declares it (its ``pyproject.toml``'s dependencies, or the course's in
``requirements/students.txt``), and otherwise the student's error.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from importlib.machinery import PathFinder
from pathlib import Path

from ..roots import SUITE_ROOT, StudentRoots, suite_paths

STUDENT_PACKAGES = ("cs336_systems", "cs336_basics")  # only ever the student's, never the grader's
COURSE_DEPENDENCIES = SUITE_ROOT / "requirements" / "students.txt"
# Distributions whose import name is not their own (a declared ``pyyaml`` is ``import yaml``).
IMPORT_NAMES = {
    "pyyaml": "yaml",
    "scikit_learn": "sklearn",
    "pillow": "PIL",
    "opencv_python": "cv2",
    "beautifulsoup4": "bs4",
}
NOWHERE, DECLARED, NO_BASICS = "nowhere", "declared", "no-basics"  # why an import is missing


@dataclass(frozen=True)
class Missing:
    """An import that cannot succeed where the worker will run it."""

    module: str  # the dotted name imported
    where: str  # FILE:LINE of the import statement
    kind: str  # NOWHERE, DECLARED or NO_BASICS

    @property
    def top(self) -> str:
        return self.module.split(".")[0]


@dataclass(frozen=True)
class _Import:
    module: str  # absolute dotted name
    names: tuple[str, ...]  # ``from module import names`` (empty for ``import module``)
    line: int
    relative: bool


@dataclass(frozen=True)
class _Source:
    file: Path
    root: Path | None  # the student's root the module was found in (None: the adapters file)
    package: str  # the dotted package the file belongs to (relative imports start here)


def missing_import(roots: StudentRoots) -> Missing | None:
    """The first module-level import of the adapters file, or of a student module it reaches, that
    cannot be found (in the order the imports run), or None."""
    search = [Path(p) for p in roots.paths()]
    queue = [_Source(roots.adapters, None, "")]
    seen: set[Path] = set()
    while queue:
        source = queue.pop(0)
        if source.file in seen:
            continue
        seen.add(source.file)
        for imp in _module_level(source):
            found = _resolve(imp, source, search)
            if isinstance(found, str):  # the dotted name that is not there
                return _missing(found, f"{source.file}:{imp.line}", roots)
            queue += found
    return None


def _missing(name: str, where: str, roots: StudentRoots) -> Missing:
    top = name.split(".")[0]
    if top == "cs336_basics" and roots.basics_root is None:
        return Missing(name, where, NO_BASICS)
    declared = top not in STUDENT_PACKAGES and _norm(top) in declared_dependencies(roots)
    return Missing(name, where, DECLARED if declared else NOWHERE)


def _module_level(source: _Source) -> Iterator[_Import]:
    """The file's unconditional imports, in order; a file that does not parse has none here (its
    worker names it)."""
    try:
        tree = ast.parse(source.file.read_bytes(), filename=str(source.file))
    except (SyntaxError, ValueError, OSError):
        return
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield _Import(alias.name, (), node.lineno, False)
        elif isinstance(node, ast.ImportFrom) and node.module != "__future__":
            absolute = _absolute(node, source.package)
            if absolute is not None:
                names = tuple(a.name for a in node.names if a.name != "*")
                yield _Import(absolute, names, node.lineno, node.level > 0)


def _absolute(node: ast.ImportFrom, package: str) -> str | None:
    """The absolute module of ``from ... import``; None for a relative import outside a package (the
    adapters file is loaded by path: its worker says what such an import does)."""
    if node.level == 0:
        return node.module
    parts = package.split(".") if package else []
    if node.level > len(parts):
        return None
    base = parts[: len(parts) - node.level + 1]
    return ".".join([*base, *([node.module] if node.module else [])]) or None


def _resolve(imp: _Import, source: _Source, search: list[Path]) -> list[_Source] | str:
    """The student's files that importing ``imp`` runs, or the dotted name that is not there. A name
    of the grading environment runs nothing of the student's."""
    top = imp.module.split(".")[0]
    root = source.root if imp.relative else _root_of(top, search)
    if root is None:
        return [] if top not in STUDENT_PACKAGES and _in_environment(top) else top
    files = _files(imp.module, root)
    if isinstance(files, str):
        return files
    for name in imp.names:  # ``from package import submodule`` runs the submodule too
        more = _files(f"{imp.module}.{name}", root)
        if not isinstance(more, str):
            files += more
    return files


def _root_of(top: str, search: list[Path]) -> Path | None:
    """The student's root ``top`` is imported from, as the worker's ``sys.path`` finds it: the first
    holding it as a module or a regular package; a bare folder (a namespace package) only where no
    module of that name is found at all, the grading environment's included; None: not the student's."""
    regular = next((r for r in search if _regular(r / top)), None)
    if regular is not None or (top not in STUDENT_PACKAGES and _in_environment(top)):
        return regular
    return next((r for r in search if (r / top).is_dir()), None)


def _regular(path: Path) -> bool:
    entry = _entry(path)
    return entry is not None and (entry.is_file() or (entry / "__init__.py").is_file())


def _entry(path: Path) -> Path | None:
    """``path`` as a package folder or a module file (``.py``, or an extension module)."""
    if path.is_dir():
        return path
    if path.with_name(path.name + ".py").is_file():
        return path.with_name(path.name + ".py")
    return next(path.parent.glob(f"{path.name}.*.so"), None) if path.parent.is_dir() else None


def _files(module: str, root: Path) -> list[_Source] | str:
    """The files importing ``module`` from ``root`` runs (each package's ``__init__.py`` on the way),
    or the dotted name that is not there."""
    parts, files, path = module.split("."), [], root
    for i, part in enumerate(parts):
        entry = _entry(path / part) if path.is_dir() else None
        if entry is None:
            return ".".join(parts[: i + 1])
        package = ".".join(parts[: i + 1])
        if entry.is_dir():
            if (entry / "__init__.py").is_file():
                files.append(_Source(entry / "__init__.py", root, package))
        elif entry.suffix == ".py":
            files.append(_Source(entry, root, ".".join(parts[:i])))
        path = entry
    return files


def _in_environment(top: str) -> bool:
    """Whether the grading environment has the top-level module (found, not imported), looked up as
    the worker looks: without the suite's own roots and import hooks."""
    if top in sys.stdlib_module_names or top in sys.builtin_module_names:
        return True
    banned = {Path(p).resolve() for p in suite_paths()}
    path = [p for p in sys.path if p and Path(p).resolve() not in banned]
    for finder in sys.meta_path:
        if "cs336" in (getattr(finder, "__module__", None) or type(finder).__module__):
            continue  # the suite's editable install: the worker drops it
        find = getattr(finder, "find_spec", None)
        try:
            if find is not None and find(top, path if finder is PathFinder else None) is not None:
                return True
        except (ImportError, ValueError, TypeError):  # a finder that cannot tell: the worker decides
            return True
    return False


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "_", name).lower()


def _requirement_names(lines: list[str]) -> set[str]:
    names = set()
    for line in lines:
        found = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", line.split("#")[0])
        if found:
            name = _norm(found.group(1))
            names |= {name, _norm(IMPORT_NAMES.get(name, name))}
    return names


def declared_dependencies(roots: StudentRoots) -> set[str]:
    """The dependencies the repository (and its ``cs336_basics``) declares, and the course's, each as a
    normalised name (``scikit-learn`` and ``scikit_learn`` alike) and as the name it is imported by."""
    lines: list[str] = []
    projects = [
        roots.repo_root,
        *([roots.basics_root, roots.basics_root.parent] if roots.basics_root else []),
    ]
    for folder in projects:
        lines += _pyproject_requirements(folder / "pyproject.toml")
    if COURSE_DEPENDENCIES.is_file():
        lines += COURSE_DEPENDENCIES.read_text().splitlines()
    return _requirement_names(lines)


def _pyproject_requirements(file: Path) -> list[str]:
    try:
        meta = tomllib.loads(file.read_text()) if file.is_file() else {}
    except (tomllib.TOMLDecodeError, OSError):
        return []
    project = meta.get("project", {})
    found = list(project.get("dependencies", []))
    found += [r for group in project.get("optional-dependencies", {}).values() for r in group]
    found += [r for group in meta.get("dependency-groups", {}).values() for r in group]
    return [r for r in found if isinstance(r, str)]
