"""What every command-line entry point shares: a parser whose usage names the command as it is
run (``python -m cs336_systems.cli.NAME``, not ``NAME.py``), whose help gives each option's default and
whose errors are two lines (what is wrong, where the options are) instead of the usage block; and the
check of an output path before a run, so that a path that cannot be written costs one error line,
not a finished benchmark and two chained tracebacks.

Standard library only: ``triton_env`` and ``benchmark`` import it before torch.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import NoReturn

PACKAGE = "cs336_systems.cli"


def prog(name: str) -> str:
    """How the command ``name`` (a module of this package) is run."""
    return f"python -m {PACKAGE}.{name}"


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Descriptions as written (their example commands keep their lines), and each option's default
    after its help, unless the help states one already or the option has none (a flag, ``None``, an
    empty list: a repeatable option given no value showed "(default: )")."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        default = action.default
        if (
            not action.option_strings
            or "default" in text.lower()
            or default is None
            or default is False
            or default == []
            or default == ()
            or default is argparse.SUPPRESS
        ):
            return text
        shown = " ".join(map(str, default)) if isinstance(default, list | tuple) else "%(default)s"
        return f"{text} (default: {shown})" if text else f"default: {shown}"


class Parser(argparse.ArgumentParser):
    """The parser of the command ``name``: ``prog`` in the module form, defaults in the help, errors in
    two lines."""

    def __init__(self, name: str, description: str | None = None, **kwargs) -> None:
        super().__init__(prog=prog(name), description=description, formatter_class=HelpFormatter, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n(--help lists the options)\n")


def _nearest_existing(path: Path) -> Path:
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path.cwd()


def unwritable(path: Path, directory: bool = False) -> str | None:
    """Why ``path`` (a file, or with ``directory`` a folder; missing folders above it are created when
    it is written) cannot be written, or None. The check creates and removes a temporary folder where
    the first missing one would go: permissions alone do not tell (root may "write" to /proc)."""
    path = Path(path)
    if path.exists():
        if directory and not path.is_dir():
            return "is a file; it names a directory"
        if not directory and path.is_dir():
            return "is a directory; give the file to write"
    anchor = path if directory and path.is_dir() else _nearest_existing(path.parent)
    if not anchor.is_dir():
        return f"{anchor} is a file, so no folder can be made under it"
    try:
        with tempfile.TemporaryDirectory(dir=anchor):
            pass
        if path.is_file():
            with path.open("a"):  # appends nothing: whether the file itself may be written
                pass
    except OSError as exc:
        where = path if path.is_file() else anchor
        return f"cannot write under {where} ({exc.strerror or exc})"
    return None


def check_outputs(parser: argparse.ArgumentParser, outputs: dict[str, tuple[Path | None, bool]]) -> None:
    """``parser.error`` (exit 2) for the first output path that cannot be written; ``outputs`` maps an
    option (``--json``) to (its path or None, whether it names a directory)."""
    for flag, (path, directory) in outputs.items():
        if path is not None and (why := unwritable(Path(path), directory)):
            parser.error(f"{flag} {path}: {why}")
