"""Make this process the student's: their roots first on ``sys.path``, none of the suite's, and
``importlib.metadata`` answering for their distributions without installing anything.

The course template's ``cs336_systems/__init__.py`` calls ``importlib.metadata.version("cs336-systems")``
(and ``cs336_basics`` the same), which fails unless the repository was installed. Instead of installing,
the worker writes a throwaway ``<name>-<version>.dist-info`` folder (METADATA only) into a temporary
directory at the head of ``sys.path``, where ``importlib.metadata`` looks first.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
import traceback
import types
from pathlib import Path

STUDENT_PACKAGES = ("cs336_systems", "cs336_basics", "tests")


class AdaptersError(Exception):
    """The adapters file cannot be loaded; the message is one line a grader can act on."""


def _resolved(entry: str) -> Path | None:
    try:
        return Path(entry or ".").resolve()
    except OSError:
        return None


def isolate(paths: list[str], suite_paths: list[str], dists: list[dict]) -> None:
    """Drop the suite's entries (and editable-install finders) from the import system, put the
    student's ``paths`` first, and register their distributions' metadata."""
    banned = {Path(p).resolve() for p in suite_paths}
    sys.path[:] = [e for e in sys.path if _resolved(e) not in banned]
    sys.meta_path[:] = [f for f in sys.meta_path if "cs336" not in type(f).__module__]
    for name in [m for m in sys.modules if m.split(".")[0] in STUDENT_PACKAGES[:2]]:
        del sys.modules[name]
    sys.path[:0] = [str(Path(p).resolve()) for p in paths] + [_metadata_dir(dists)]


def _metadata_dir(dists: list[dict]) -> str:
    root = Path(tempfile.mkdtemp(prefix="cs336-grade-dist-"))
    for dist in dists:
        info = root / f"{dist['name'].replace('-', '_')}-{dist['version']}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {dist['name']}\nVersion: {dist['version']}\n"
        )
    return str(root)


def _at(exc: BaseException, path: Path) -> str:
    """Where the import raised: FILE:LINE of the innermost frame outside importlib (else ``path``)."""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename]
    frame = frames[-1] if frames else None
    return f"{frame.filename}:{frame.lineno}" if frame else str(path)


def _where(exc: BaseException, path: Path) -> str:
    return f" ({_at(exc, path)})"


def load_adapters(path: str) -> types.ModuleType:
    """The adapters module, imported by file path under a private name. Every way it can fail to
    load becomes one :class:`AdaptersError` line."""
    file = Path(path).resolve()
    if not file.is_file():
        raise AdaptersError(f"no adapters file at {file}")
    spec = importlib.util.spec_from_file_location("cs336_graded_adapters", file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        raise AdaptersError(f"does not parse: {exc.msg} ({exc.filename}:{exc.lineno})") from None
    except ModuleNotFoundError as exc:
        raise AdaptersError(_missing_module(exc, file)) from None
    except ImportError as exc:
        raise AdaptersError(f"adapters import failed: {exc}{_where(exc, file)}") from None
    except Exception as exc:
        raise AdaptersError(
            f"importing the adapters raised {type(exc).__name__}: {exc}{_where(exc, file)}"
        ) from None
    return module


def _missing_module(exc: ModuleNotFoundError, file: Path) -> str:
    top = (exc.name or "").split(".")[0]
    if top in STUDENT_PACKAGES:
        searched = ", ".join(p for p in sys.path[:3])
        return (
            f"adapters import failed: no module named {exc.name!r} (imported at {_at(exc, file)}); searched the "
            f"student's roots first ({searched}); point --repo-root / --package-root / --basics-root at it"
        )
    return (
        f"missing dependency {top!r} (imported at {_at(exc, file)}): install it into the grading "
        f"environment, e.g. `pip install {top}`"
    )
