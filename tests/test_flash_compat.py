"""kernels/flash/compat.py: the private hooks' versions, pinned in pyproject.toml, refused elsewhere in one
line; no other module of kernels/flash reads a compiled kernel's internals; and every launch that does not
take a plan's fast path (the launcher's C entry point) is recorded with its reason in what ``launched``
reports."""

from __future__ import annotations

import ast
import contextlib
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from packaging.requirements import Requirement

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash import compat
from cs336_systems.kernels.flash.launch import INTERPRETED, KernelPlan, Launch, fwd_launch

from .helpers.attention import make_inputs

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


# -- Triton's internals stay in compat.py; every launch that bypasses the plan's C entry point says so -----

FLASH = ROOT / "src" / "cs336_systems" / "kernels" / "flash"
# What a compiled kernel (triton 3.6's CompiledKernel) and its launcher hold that no public API offers.
INTERNALS = frozenset(
    {
        "run",
        "function",
        "packed_metadata",
        "metadata",
        "tensordesc_meta",
        "launch_cooperative_grid",
        "launch_pdl",
        "global_scratch_size",
        "profile_scratch_size",
    }
)


def _internal_reads(path: Path) -> list[str]:
    """``file:line name`` for every attribute of :data:`INTERNALS` that ``path`` reads: ``x.name`` or
    ``getattr(x, "name")`` / ``hasattr`` / ``setattr``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        name = None
        if isinstance(node, ast.Attribute):
            name = node.attr
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) in (
            "getattr",
            "hasattr",
            "setattr",
        ):
            arg = node.args[1] if len(node.args) > 1 else None
            name = arg.value if isinstance(arg, ast.Constant) else None
        if name in INTERNALS:
            found.append(f"{path.name}:{node.lineno} {name}")
    return found


def test_only_compat_reads_compiled_kernel_internals() -> None:
    # Break tried: launch.py reading k.metadata.tensordesc_meta or calling k.run(..., k.packed_metadata, ...)
    # again -> listed here.
    reads = [r for p in sorted(FLASH.glob("*.py")) if p.name != "compat.py" for r in _internal_reads(p)]
    assert not reads, f"Triton internals read outside kernels/flash/compat.py: {reads}"
    assert _internal_reads(FLASH / "compat.py"), "compat.py reads none: the scan looks for the wrong names"


def test_the_internals_scan_sees_reads(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "def f(k, plan):\n    metas = getattr(k.metadata, 'tensordesc_meta', None)\n"
        "    k.run(1, 1, 1, 0, k.function, k.packed_metadata)\n    return plan.launch, plan.fallbacks\n"
    )
    assert set(_internal_reads(tmp_path / "m.py")) == {
        "m.py:2 metadata",
        "m.py:2 tensordesc_meta",
        "m.py:3 run",
        "m.py:3 function",
        "m.py:3 packed_metadata",
    }


class FakeRun:
    """A compiled kernel's launcher: called, it is Triton's Python wrapper; ``launch``, its C entry point,
    wrapping (as Triton's descriptor wrapper does) the ``launcher`` it was given, if any."""

    def __init__(self, scratch: int, launcher=None):
        self.global_scratch_size, self.profile_scratch_size = scratch, 0
        self.launch_cooperative_grid, self.launch_pdl = False, False
        self.calls: list[tuple] = []
        if launcher is None:
            self.launch = lambda *args: self.calls.append(("c entry", args))
        else:
            self.launch = lambda *args: launcher(*args)  # a closure over its cell "launcher"

    def __call__(self, *args) -> None:
        self.calls.append(("wrapper", args))


class FakeCompiled:
    """What compat.kernel_launcher reads of triton 3.6's CompiledKernel."""

    def __init__(self, scratch: int = 0, launcher=None, tensordesc_meta=None):
        self.run = FakeRun(scratch, launcher)
        self.function, self.packed_metadata = 1234, ("packed",)
        self.metadata = SimpleNamespace(tensordesc_meta=tensordesc_meta)


def _raw(*args) -> None:
    """The launcher under a descriptor wrapper."""


@pytest.mark.parametrize(
    "compiled, descriptors, entry, fallback",
    [
        (FakeCompiled(), False, "c entry", None),
        (FakeCompiled(launcher=_raw, tensordesc_meta=[{"box": 1}]), True, "raw", None),
        (FakeCompiled(scratch=256), False, "wrapper", compat.SCRATCH_FALLBACK),
        (FakeCompiled(scratch=256), True, "wrapper", compat.SCRATCH_FALLBACK),
        (FakeCompiled(tensordesc_meta=[{"box": 1}]), True, "c entry", compat.UNWRAPPED_FALLBACK),
        (FakeCompiled(launcher=_raw, tensordesc_meta=[None]), True, "c entry", compat.NO_TMA_FALLBACK),
    ],
    ids=["c-entry", "raw-under-wrapper", "scratch", "scratch-descriptors", "no-inner-launcher", "no-tma"],
)
def test_kernel_launcher_says_why_it_falls_back(compiled, descriptors, entry, fallback) -> None:
    got = compat.kernel_launcher(compiled, descriptors)
    expected = {"c entry": compiled.run.launch, "raw": _raw, "wrapper": compiled.run}[entry]
    assert got.launch is expected and got.fallback == fallback
    assert got.prefix[0] == compiled.function and compiled.packed_metadata in got.prefix
    assert (got.tma_meta is not None) == (entry == "raw")


def test_a_plan_launches_through_tritons_launcher_and_records_why(device, generator, monkeypatch) -> None:
    # A compiled kernel that needs scratch memory (faked: the CPU compiles nothing) is launched through
    # Triton's own launcher with the packed metadata, device addresses and scalars, and the plan says so.
    # Break tried: KernelPlan dropping the reason -> fails.
    q, k, v, _ = make_inputs((2, 32, 32, 16), torch.float32, device, generator)
    q, k, v = (t.detach()[:, None] for t in (q, k, v))
    o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=device)
    compiled = FakeCompiled(scratch=256)
    monkeypatch.setattr(Launch, "jit", lambda self: compiled)
    plan = KernelPlan(fwd_launch(flash.TileConfig(16, 16), True, q, k, v, o, lse))
    assert plan.fallbacks == (f"flash_fwd_kernel: {compat.SCRATCH_FALLBACK}",)
    plan(0, q, k, v, o, lse)
    [(how, args)] = compiled.run.calls
    assert how == "wrapper" and args[:9] == (2, 2, 1, 0, 1234, ("packed",), None, None, None)
    assert args[9:14] == tuple(t.data_ptr() for t in (q, k, v, o, lse))


def test_launched_reports_every_fallback(device, generator, monkeypatch, fresh_flash) -> None:
    # What a bench row copies (flash.launched_info) names each pass's fallback from the plan's C entry
    # point. On the CPU the interpreter is one, and a launcher fallback forced on any device (every
    # compiled kernel faked as needing scratch) is recorded for every pass, the backward's included.
    # Breaks tried: the attention plan recording the pass without its plan's fallbacks -> fails.
    case = (2, 32, 32, 16, True, torch.float32)
    configs = {kernel: flash.TileConfig(16, 16) for kernel in flash.KERNELS}

    def run() -> dict:
        flash.clear_tuning_cache()
        q, k, v, do = make_inputs((2, 32, 32, 16), torch.float32, device, generator)
        with contextlib.ExitStack() as stack:
            for kernel, config in configs.items():
                stack.enter_context(flash.forced(kernel, config))
            FlashAttentionTriton.apply(q, k, v, True).backward(do)
        return flash.launched_info(case)["launched"]

    names = {"fwd": "flash_fwd_kernel", "dq": "flash_bwd_dq_kernel", "dkdv": "flash_bwd_dkdv_kernel"}
    ran = run()
    for p, name in names.items():
        expected = [f"{name}: {INTERPRETED}"] if flash.INTERPRET else None
        assert ran[p].get("fallbacks") == expected, (p, ran[p])
    jit = Launch.jit
    monkeypatch.setattr(Launch, "jit", lambda self: (jit(self), FakeCompiled(scratch=256))[1])
    ran = run()
    for p, name in names.items():
        assert ran[p]["fallbacks"] == [f"{name}: {compat.SCRATCH_FALLBACK}"], (p, ran[p])
