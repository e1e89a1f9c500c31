"""kernels/flash/compat.py: the private hooks' versions, pinned in pyproject.toml, refused elsewhere in one
line."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from cs336_systems.kernels.flash import compat

ROOT = Path(__file__).resolve().parents[1]


def _pins() -> dict[str, Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return {r.name: r for r in map(Requirement, deps)}


def test_pyproject_pins_what_compat_targets() -> None:
    pins = _pins()
    assert str(pins["triton"].specifier) == f"=={compat.TRITON_TARGET}.0"
    for minor in compat.TORCH_TARGETS:
        assert pins["torch"].specifier.contains(f"{minor}.0"), (minor, pins["torch"])
    assert not pins["torch"].specifier.contains("2.10.0") and not pins["torch"].specifier.contains("2.14.0")


@pytest.mark.parametrize(("triton_version", "torch_version"), [("3.5.1", "2.11.0"), ("3.6.0", "2.9.1+cu128")])
def test_other_versions_fail_in_one_line(triton_version: str, torch_version: str) -> None:
    with pytest.raises(RuntimeError) as err:
        compat.check_versions(triton_version, torch_version)
    message = str(err.value)
    assert "\n" not in message and triton_version in message and torch_version in message


def test_the_targeted_versions_pass() -> None:
    compat.check_versions("3.6.0", "2.11.0+cu130")
    compat.check_versions("3.6.0", "2.13.0+cpu")
