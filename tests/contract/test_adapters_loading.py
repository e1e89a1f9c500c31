"""Reading an adapters file (``grading.probe``, from its source: which hooks are blank) and loading it
in a worker (``isolate.load_adapters``): a hook is "not implemented" only by what its source says, never
by what a call raises; the guard against grading the suite's own code; the benches' adapters rows
(absent without ``--adapters``)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.grading.probe import ALL_HOOKS, probe
from cs336_systems.grading.roots import SUITE_PACKAGE
from cs336_systems.grading.worker.hooks import Hooks, SuiteCodeGraded
from cs336_systems.grading.worker.isolate import AdaptersError, load_adapters

from .grading_run import DATA, ROOT, clean_env

SOURCE = '''
def get_ddp(module):
    """docstring"""
    raise NotImplementedError


def get_fsdp(module, compute_dtype=None):
    raise NotImplementedError("todo")


def _helper():
    raise NotImplementedError


def ddp_on_after_backward(ddp_model, optimizer):
    return _helper()


def get_sharded_optimizer(params, cls, **kwargs):
    return cls(params, **kwargs)


if True:
    def fsdp_gather_full_params(model):
        return {}
'''


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "adapters.py"
    path.write_text(text)
    return path


def test_blank_hooks_are_read_from_the_source(tmp_path: Path) -> None:
    found = probe(_write(tmp_path, SOURCE))
    assert "raises NotImplementedError" in found.reason("get_ddp")
    assert "raises NotImplementedError" in found.reason("get_fsdp")
    # raising deeper (in a helper) is the student's code failing, not a blank hook
    assert found.reason("ddp_on_after_backward") is None
    assert found.reason("get_sharded_optimizer") is None
    assert found.reason("fsdp_gather_full_params") is None, "bound inside a top-level block"
    assert "not defined" in found.reason("get_flashattention_autograd_function_triton")


def test_an_edition_is_read_from_its_own_hooks(tmp_path: Path) -> None:
    """A 2026 file (it defines get_ddp) that star-imports: 1.0.5's own hooks are absent from it, the
    hooks both editions share may come from the import and are graded."""
    found = probe(
        _write(tmp_path, "from cs336_systems.everything import *\n\n\ndef get_ddp(m):\n    return m\n")
    )
    assert found.absent(("get_ddp_bucketed", "ddp_bucketed_on_after_backward"))
    assert found.reason("get_flashattention_autograd_function_pytorch") is None
    assert not found.absent(("get_sharded_optimizer",))
    dynamic = probe(_write(tmp_path, "globals().update(make_hooks())\n"))
    assert not dynamic.blank and set(dynamic.defined) == set(ALL_HOOKS)


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AdaptersError, match="no adapters file"):
        load_adapters(str(tmp_path / "nope.py"))


def test_guard_refuses_the_suites_own_code(tmp_path: Path) -> None:
    """A hook answered by a class from the suite's package is refused, not graded (what shadowing
    did); the same hook is fine when the suite grades itself (no forbidden folder)."""
    from cs336_systems.grading.shared.course_layers import Linear

    module = load_adapters(str(_write(tmp_path, "def done(x):\n    return x + 1\n")))
    module.suite_class = lambda: Linear
    with pytest.raises(SuiteCodeGraded, match="inside the grading suite's own package"):
        Hooks(module, str(SUITE_PACKAGE)).suite_class()
    assert Hooks(module, None).suite_class() is Linear
    assert Hooks(module, str(SUITE_PACKAGE)).done(1) == 2


def _pytest(*args: str) -> str:
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs", *args]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    return run.stdout + run.stderr


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("suite_self_check")
def test_bench_rows_exist_only_with_adapters() -> None:
    """Without --adapters a bench has no adapters row; with a blank template the row skips, naming
    the hook, before any rank is spawned."""
    bench = ["bench/bench_sharding.py", "--benchmark-disable"]
    assert "-adapters]" not in _pytest(*bench, "--collect-only")
    out = _pytest(*bench, "-k", "adapters", "--adapters", str(DATA / "blank_adapters_26_1_1.py"))
    assert "get_sharded_optimizer: not implemented" in out and "1 skipped" in out, out[-2000:]
