"""The adapters loader itself (``cs336_systems.harness.adapters``): which hooks count as not
implemented. A NotImplementedError raised deep inside a student's code is a bug to report, not a
blank hook to skip."""

from __future__ import annotations

from pathlib import Path

import pytest

from cs336_systems.harness.adapters import HookNotImplemented, blank_hook, call_hook, load_adapters

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
    return load_adapters(path)


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
    with pytest.raises(FileNotFoundError, match="no adapters file"):
        load_adapters(tmp_path / "nope.py")
