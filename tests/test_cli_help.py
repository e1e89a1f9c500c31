"""Every command-line entry point answers ``--help`` as a new user reads it: ``triton_env`` printed
nothing, usage lines said ``X.py``, options had neither help nor a default, one help cited a SPEC.md the
repository does not hold, and one told the project's own history. Each CLI runs here as ``python -m``
runs it (``runpy``, in this process: no interpreter start per command). ``cli/grade.py`` is the grader's
own and is left out of that check. ``--help`` imports no torch, triton or numpy (seconds on a loaded
machine): checked in a fresh process per command; the choices the parsers spell for that are the
library's."""

from __future__ import annotations

import argparse
import os
import re
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CLI = ROOT / "src" / "cs336_systems" / "cli"
NOT_COMMANDS = {"__init__", "common", "choices", "grade"}  # the package, shared parts, the grader's own
COMMANDS = sorted(p.stem for p in CLI.glob("*.py") if p.stem not in NOT_COMMANDS)
# cli.report runs report.writeup.main, whose usage names the form the README documents
ALIASES = {"report": "python -m cs336_systems.report"}
# What a help text may cite as a file of the repository (example output names such as lb.json aside)
FILE_REFERENCE = re.compile(r"[\w./-]+\.(?:md|py|toml|ini|sh|cfg|txt)\b")
WRITTEN = {"writeup.md"}  # files a command writes, named in its help: not citations
HISTORY = re.compile(r"\bissues? \d+", re.IGNORECASE)  # the project's tracker, which a user has not seen


def _repository_files() -> list[str]:
    tops = [p for p in ROOT.iterdir() if p.is_file()]
    nested = [
        p for d in ("src", "docs", "bench", "scripts", "tests", "requirements") for p in (ROOT / d).rglob("*")
    ]
    return [p.relative_to(ROOT).as_posix() for p in (*tops, *nested) if p.is_file()]


def _help_of(name: str, monkeypatch: pytest.MonkeyPatch) -> tuple[str, argparse.ArgumentParser]:
    """What ``python -m cs336_systems.cli.NAME --help`` prints, and the parser that printed it."""
    printed: list[argparse.ArgumentParser] = []
    original = argparse.ArgumentParser.print_help
    monkeypatch.setattr(
        argparse.ArgumentParser,
        "print_help",
        lambda self, file=None: printed.append(self) or original(self, file),
    )
    monkeypatch.setattr(sys, "argv", [name, "--help"])  # runpy puts the module's path first, as -m does
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the module is imported already: runpy says so
        with pytest.raises(SystemExit) as exc:
            runpy.run_module(f"cs336_systems.cli.{name}", run_name="__main__", alter_sys=True)
    assert exc.value.code in (0, None), f"{name} --help exited {exc.value.code}"
    assert len(printed) == 1, f"{name} --help printed no parser's help"
    return printed[0].format_help(), printed[0]


@pytest.mark.parametrize("name", COMMANDS)
def test_help_names_the_command_documents_every_option_and_cites_only_files_that_exist(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    text, parser = _help_of(name, monkeypatch)
    out = capsys.readouterr().out
    assert out.strip() and out == text
    prog = ALIASES.get(name, f"python -m cs336_systems.cli.{name}")
    assert parser.prog == prog and out.startswith(f"usage: {prog}")
    formatter = parser._get_formatter()
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction):
            continue
        what = f"{name} {'/'.join(action.option_strings) or action.dest}"
        shown = formatter._expand_help(action) if action.help else ""
        assert shown.strip(), f"{what}: no help text"
        default = action.default
        if action.option_strings and default not in (None, False, argparse.SUPPRESS):
            values = default if isinstance(default, list | tuple) else [default]
            assert all(str(v) in shown for v in values), (
                f"{what}: its default {default!r} is not in {shown!r}"
            )
    assert not HISTORY.search(out), f"{name} --help tells the project's history: {HISTORY.search(out)[0]}"
    files = _repository_files()
    for reference in set(FILE_REFERENCE.findall(out)) - WRITTEN:
        assert any(f == reference or f.endswith("/" + reference) for f in files), f"{name} cites {reference}"


def test_the_check_sees_a_missing_default_and_a_missing_file(monkeypatch: pytest.MonkeyPatch) -> None:
    """The checks above can fail: an option without help and a cited file that does not exist."""
    from cs336_systems.cli.common import Parser

    parser = Parser("nothing", description="see SPEC.md")
    parser.add_argument("--ctx", type=int, default=512)
    (ctx,) = [a for a in parser._actions if a.dest == "ctx"]
    assert parser._get_formatter()._expand_help(ctx) == "default: 512"  # the default, at least
    assert FILE_REFERENCE.findall(parser.format_help()) == ["SPEC.md"]
    assert not any(f.endswith("SPEC.md") for f in _repository_files())


# Runs one command's --help as ``python -m`` would, then names the heavy packages it imported.
_HELP_PROBE = (
    "import runpy, sys\n"
    "name = sys.argv[1]\n"
    "sys.argv = [name, '--help']\n"
    "try:\n"
    "    runpy.run_module(f'cs336_systems.cli.{name}', run_name='__main__', alter_sys=True)\n"
    "except SystemExit as exc:\n"
    "    heavy = [m for m in ('torch', 'triton', 'numpy') if m in sys.modules]\n"
    "    sys.stderr.write('imported: ' + ' '.join(heavy) + '\\n')\n"
    "    raise\n"
)


def help_imports(name: str) -> list[str]:
    """Which of torch, triton and numpy ``python -m cs336_systems.cli.NAME --help`` imports (a fresh
    process)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # as a user's shell has it
    cmd = [sys.executable, "-c", _HELP_PROBE, name]
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.startswith("usage:"), run.stderr[-2000:]
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("imported:"), run.stderr[-2000:]
    return last.removeprefix("imported:").split()


# cli.report runs the report package's main: that package imports pandas (so numpy) for its tables
HEAVY_FOR_HELP = {"report": {"numpy"}}


@pytest.mark.parametrize("name", sorted({*COMMANDS, "grade"}))
def test_help_imports_no_torch_triton_or_numpy(name: str) -> None:
    heavy = set(help_imports(name)) - HEAVY_FOR_HELP.get(name, set())
    assert not heavy, f"{name} --help imported {' and '.join(sorted(heavy))}"


def test_allreduce_names_the_sweeps_sizes() -> None:
    """``cli.allreduce`` spells the sizes for its help (the sweep's module imports torch): the same."""
    from cs336_systems.cli.allreduce import SIZE_NAMES
    from cs336_systems.distributed.allreduce import SIZES

    assert ",".join(SIZES) == SIZE_NAMES


def test_the_parsers_choices_and_defaults_are_the_librarys() -> None:
    """``cli.choices`` spells them for the parsers (their modules import torch): the same values."""
    from cs336_systems.cli import choices
    from cs336_systems.cli.flash_tune import SHAPE_SET_NAMES, shape_sets
    from cs336_systems.harness.train_step import OPTIMIZERS, VARIANTS
    from cs336_systems.model import BATCH_SIZE, PRESETS
    from cs336_systems.profiling.flops import MODES
    from cs336_systems.profiling.workload import DTYPES, MODE_ALIASES
    from cs336_systems.training import options

    assert (tuple(sorted(PRESETS)), BATCH_SIZE) == (choices.PRESET_NAMES, choices.BATCH_SIZE)
    assert (MODES, tuple(MODE_ALIASES)) == (choices.MODES, choices.MODE_ALIASES)
    assert tuple(sorted(DTYPES)) == choices.DTYPE_NAMES
    assert (choices.DDP_VARIANTS, choices.DDP_OPTIMIZERS) == (VARIANTS, OPTIMIZERS)
    assert tuple(sorted(options.RECIPES)) == choices.RECIPE_NAMES
    assert choices.FSDP_CHOICES == options.FSDP_CHOICES and choices.LOSS_CHOICES == options.LOSS_CHOICES
    assert choices.OPTIMIZER_CHOICES == options.OPTIMIZER_CHOICES
    defaults = options.StepOptions()
    assert {k: getattr(defaults, k) for k in choices.STEP_DEFAULTS} == choices.STEP_DEFAULTS
    assert tuple(sorted(shape_sets())) == SHAPE_SET_NAMES
