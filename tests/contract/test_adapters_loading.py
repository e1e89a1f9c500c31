"""Calling hooks (``cs336_systems.grading.worker.hooks``): which count as not implemented (a
NotImplementedError raised deep inside a student's code is a bug to report, not a blank hook to skip),
the guard against grading the suite's own code, and the benches' adapters rows (absent without
``--adapters``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.grading.roots import SUITE_PACKAGE
from cs336_systems.grading.settings import ADAPTERS_ENV as ENV_VAR
from cs336_systems.grading.worker.hooks import (
    HookNotImplemented,
    Hooks,
    SuiteCodeGraded,
    blank_hook,
    call_hook,
)
from cs336_systems.grading.worker.isolate import AdaptersError, load_adapters

SOURCE = '''
def blank():
    """docstring"""
    raise NotImplementedError


def blank_call():
    raise NotImplementedError("todo")


def _helper():
    raise NotImplementedError


def deep():
    return _helper()


def done(x):
    return x + 1
'''


@pytest.fixture
def module(tmp_path: Path):
    path = tmp_path / "my_adapters.py"
    path.write_text(SOURCE)
    return load_adapters(str(path))


def test_blank_and_missing_hooks_are_not_implemented(module) -> None:
    for hook in ("blank", "blank_call", "absent"):
        assert isinstance(blank_hook(module, hook), HookNotImplemented), hook
        with pytest.raises(HookNotImplemented, match=hook):
            call_hook(module, hook)


def test_deep_not_implemented_error_propagates(module) -> None:
    assert blank_hook(module, "deep") is None
    with pytest.raises(NotImplementedError) as info:
        call_hook(module, "deep")
    assert not isinstance(info.value, HookNotImplemented)
    assert blank_hook(module, "done") is None and call_hook(module, "done", 1) == 2


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(AdaptersError, match="no adapters file"):
        load_adapters(str(tmp_path / "nope.py"))


def test_guard_refuses_the_suites_own_code(module) -> None:
    """A hook answered by a class from the suite's package is refused, not graded (what shadowing
    did); the same hook is fine when the suite grades itself (no forbidden folder)."""
    from cs336_systems.grading.worker.course_layers import Linear

    module.suite_class = lambda: Linear
    with pytest.raises(SuiteCodeGraded, match="inside the grading suite's own package"):
        Hooks(module, str(SUITE_PACKAGE)).suite_class()
    assert Hooks(module, None).suite_class() is Linear
    assert Hooks(module, str(SUITE_PACKAGE)).done(1) == 2


def _pytest(*args: str) -> str:
    root = Path(__file__).resolve().parents[2]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop(ENV_VAR, None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-n", "0", "-q", "-rs", *args]
    run = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=120)
    return run.stdout + run.stderr


@pytest.mark.timeout(180)
@pytest.mark.usefixtures("suite_self_check")
def test_bench_rows_exist_only_with_adapters() -> None:
    """Without --adapters a bench has no adapters row; with a blank template the row skips, naming
    the hook, before any rank is spawned."""
    bench = ["bench/bench_sharding.py", "--benchmark-disable"]
    assert "-adapters]" not in _pytest(*bench, "--collect-only")
    out = _pytest(*bench, "-k", "adapters", "--adapters", "tests/data/blank_adapters_26_1_1.py")
    assert "get_sharded_optimizer: not implemented" in out and "1 skipped" in out, out[-2000:]
