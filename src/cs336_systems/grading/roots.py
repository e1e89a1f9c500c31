"""Where a student's code lives, found from the path of their adapters file.

Course repositories put ``tests/adapters.py`` under the repository root; the package ``cs336_systems``
sits at the root or under ``src/`` (``[tool.uv.build-backend] module-root`` says which), and
``cs336_basics`` wherever ``[tool.uv.sources]`` points ``cs336-basics`` (``./cs336-basics``, a folder of
their own, or a path outside the repository). Each can be overridden.
"""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import cs336_systems

from .shared.repository import ENVIRONMENT_DIRS

SUITE_PACKAGE = Path(cs336_systems.__file__).resolve().parent
SUITE_SRC = SUITE_PACKAGE.parent
SUITE_ROOT = SUITE_SRC.parent if SUITE_SRC.name == "src" else SUITE_SRC


# Folders of a repository that hold none of its code: not walked for its files (freshness, access, its
# kernels' names). A Python environment inside it is libraries (``shared/repository.py``), on both sides.
SKIP_DIRS = ENVIRONMENT_DIRS | {".git", "__pycache__", "node_modules", ".pytest_cache", "wandb"}


class GradingSetupError(Exception):
    """What is wrong with the grading request, in one line."""


@dataclass(frozen=True)
class StudentRoots:
    adapters: Path
    repo_root: Path
    package_root: Path | None
    basics_root: Path | None
    dists: dict[str, str] = field(default_factory=dict)

    @property
    def self_grade(self) -> bool:
        """The suite grading its own package (its ``tests/adapters.py`` and self-check fixtures)."""
        return self.package_root is not None and self.package_root.resolve() == SUITE_SRC

    def paths(self) -> list[str]:
        """``sys.path`` entries of the worker, in order: the package, ``cs336_basics``, the repo root
        (``tests.*`` and top-level helper packages)."""
        found = [p for p in (self.package_root, self.basics_root, self.repo_root) if p is not None]
        return [str(p) for p in dict.fromkeys(found)]

    def folders(self) -> list[Path]:
        """The folders whose files are the student's (provenance and failure frames are judged by them)."""
        return [Path(p) for p in self.paths()]

    def describe(self) -> str:
        return (
            f"adapters {self.adapters}; package root {self.package_root or '(none found)'}; "
            f"cs336_basics {self.basics_root or '(none found)'}"
        )


def _pyproject(folder: Path) -> dict:
    file = folder / "pyproject.toml"
    try:
        return tomllib.loads(file.read_text()) if file.is_file() else {}
    except tomllib.TOMLDecodeError as exc:
        raise GradingSetupError(f"{file} does not parse: {exc}") from None


def _holding(package: str, *candidates: Path) -> Path | None:
    return next((c for c in candidates if (c / package).is_dir()), None)


def _repo_root(adapters: Path) -> Path:
    for folder in adapters.parents:
        if (folder / "pyproject.toml").is_file():
            return folder
    return adapters.parent.parent if adapters.parent.name == "tests" else adapters.parent


def _basics_root(repo: Path, meta: dict) -> Path | None:
    source = meta.get("tool", {}).get("uv", {}).get("sources", {}).get("cs336-basics", {})
    folder = (repo / source["path"]).resolve() if isinstance(source, dict) and "path" in source else None
    candidates = [folder, folder / "src"] if folder else []
    return _holding("cs336_basics", *candidates, repo, repo / "src", repo / "cs336-basics")


def discover(
    adapters: str | Path,
    repo_root: str | Path | None = None,
    package_root: str | Path | None = None,
    basics_root: str | Path | None = None,
) -> StudentRoots:
    file = Path(adapters).expanduser().resolve()
    if file.is_dir():
        hint = file / "tests" / "adapters.py"
        more = f" (its adapters file is {hint})" if hint.is_file() else " and holds no tests/adapters.py"
        raise GradingSetupError(f"{file} is a folder, not an adapters file{more}")
    if not file.is_file():
        raise GradingSetupError(f"no adapters file at {file}")
    for flag, value in (
        ("--repo-root", repo_root),
        ("--package-root", package_root),
        ("--basics-root", basics_root),
    ):
        if value is not None and not Path(value).expanduser().is_dir():
            raise GradingSetupError(f"{flag} {value}: no such folder")
    repo = Path(repo_root).resolve() if repo_root else _repo_root(file)
    meta = _pyproject(repo)
    module_root = meta.get("tool", {}).get("uv", {}).get("build-backend", {}).get("module-root")
    declared = [repo / module_root] if module_root is not None else []
    package = (
        Path(package_root).resolve()
        if package_root
        else _holding("cs336_systems", *declared, repo / "src", repo)
    )
    basics = Path(basics_root).resolve() if basics_root else _basics_root(repo, meta)
    basics_meta = _pyproject(basics.parent if basics and basics.name == "src" else basics) if basics else {}
    dists = {
        "cs336-systems": str(meta.get("project", {}).get("version", "0.0.0")),
        "cs336-basics": str(basics_meta.get("project", {}).get("version", "0.0.0")),
    }
    return StudentRoots(file, repo, package, basics, dists)


def suite_paths() -> list[str]:
    """The suite's own ``sys.path`` entries, which a worker drops (not site-packages, where the suite
    may be installed beside torch: there the student's roots, put first, win and the guard checks)."""
    return [str(p) for p in (SUITE_SRC, SUITE_ROOT) if not (p / "torch").is_dir()]


def grader_pythonpath(environ: dict[str, str]) -> list[str]:
    """``PYTHONPATH`` entries a process of the graded code keeps: what the grader installed beside
    (``--target`` folders), absolute (it runs in the student's repository), without the suite's roots."""
    banned = {Path(p).resolve() for p in suite_paths()}
    kept = [Path(p).resolve() for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return [str(p) for p in kept if p not in banned]
