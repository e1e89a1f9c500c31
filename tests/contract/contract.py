"""What every contract test shares: the hooks of the adapters file under test, the per-rank case
runner that turns a blank hook into a skip, and failure messages that say how far a value missed.

Only the adapters' hooks are called on the implementation; the references are plain PyTorch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import pytest
import torch

from cs336_systems.harness.adapters import HookNotImplemented, call_hook, load_adapters

DEFAULT_ADAPTERS = Path(__file__).resolve().parents[1] / "adapters.py"


class Hooks:
    """The hooks of one adapters file; ``hooks.name(*args)`` calls the hook, and a hook that is
    missing or blank raises :class:`HookNotImplemented` (a skip in the parent, see ``skip_blank``)."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.module = load_adapters(path)

    def __getattr__(self, hook: str) -> Callable[..., Any]:
        return lambda *args, **kwargs: call_hook(self.module, hook, *args, **kwargs)


def skip_blank(fn: Callable[[], Any]) -> Any:
    """``fn()``, skipping the test with the hook's name when it reaches a blank hook."""
    try:
        return fn()
    except HookNotImplemented as exc:
        pytest.skip(exc.skip_reason)


def run_rank_cases(path: str, runner: Callable[[Hooks, Any], Any], cases: list[Hashable]) -> dict:
    """Rank function body: ``runner(hooks, case)`` for each case. A blank hook becomes
    ``{"skip": reason}`` (every rank reaches it at the same point, so none is left waiting); any
    other error fails the rank, and with it the spawn, fast."""
    hooks = Hooks(path)
    out: dict = {}
    for case in cases:
        try:
            out[case] = runner(hooks, case)
        except HookNotImplemented as exc:
            out[case] = {"skip": exc.skip_reason}
    return out


def case_results(per_rank: list[dict], case: Hashable) -> list[Any]:
    """Every rank's result of ``case``; skips the test when a hook it needs is blank."""
    results = [r[case] for r in per_rank]
    for r in results:
        if isinstance(r, dict) and "skip" in r:
            pytest.skip(r["skip"])
    return results


def selected_cases(request: pytest.FixtureRequest, world_size: int) -> tuple:
    """The ``case`` parameters of this module's selected tests (after ``-k`` / deselection) at
    ``world_size``: one spawn per world size runs just those, so a ``-k`` run stays cheap."""
    return tuple(
        item.callspec.params["case"]
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and item.callspec.params.get("world_size") == world_size
    )


class SpawnCache:
    """``cache(fn, world_size, *args)`` -> per-rank results of ``fn(*args)`` on ``world_size`` gloo
    ranks, spawned once per arguments (spawning costs seconds). A failed spawn fails every test that
    needs it with the same error, without spawning again."""

    def __init__(self, spawn: Callable[..., list], timeout: float):
        self.spawn, self.timeout = spawn, timeout
        self.done: dict[tuple, list | Exception] = {}

    def __call__(self, fn: Callable, world_size: int, *args: Any) -> list:
        key = (fn.__module__, fn.__qualname__, world_size, *args)
        if key not in self.done:
            try:
                self.done[key] = self.spawn(fn, world_size, *args, backend="gloo", timeout=self.timeout)
            except Exception as exc:
                self.done[key] = exc
        result = self.done[key]
        if isinstance(result, Exception):
            raise RuntimeError(f"the {world_size}-rank run of {fn.__qualname__} failed: {result}") from result
        return result


def fmt(x: float) -> str:
    return f"{x:.2g}" if math.isfinite(x) else str(x)


def miss(prop: str, got: torch.Tensor, ref: torch.Tensor, atol: float, rtol: float, where: str) -> str | None:
    """None when ``|got - ref| <= atol + rtol |ref|`` everywhere, else a message naming the property
    and by how much it missed."""
    if got.shape != ref.shape:
        return f"{prop}: shape {tuple(got.shape)} != expected {tuple(ref.shape)} ({where})"
    got64, ref64 = got.detach().double().cpu(), ref.detach().double().cpu()
    err = (got64 - ref64).abs()
    if torch.isfinite(got64).all() and bool((err <= atol + rtol * ref64.abs()).all()):
        return None
    return (
        f"max |{prop} - ref| = {fmt(err.max().item())} > atol {atol:g} + rtol {rtol:g}·|ref| "
        f"(max |ref| {fmt(ref64.abs().max().item())}; {where})"
    )


def assert_no_misses(misses: list[str | None]) -> None:
    found = [m for m in misses if m]
    assert not found, "\n".join(found)
