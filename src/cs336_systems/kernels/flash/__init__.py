# ruff: noqa: F401  (this module re-exports the package's public names)
"""FlashAttention-2 in Triton (and Gluon on Hopper): kernels, launches, plans and tuning.

Layout (FlashAttention's ``hopper/`` split of kernel, launch and interface; the autograd function and the
routing live in ``attention/flash_triton.py``):

- ``triton_tiles``, ``triton_fwd``, ``triton_bwd``: the Triton kernels (forward; split backward: dQ pass
  writing D, then dK/dV pass);
- ``gluon_common``, ``gluon_fwd``, ``gluon_bwd``: their Gluon twins for Hopper, with hand-issued
  asynchronous matmuls; ``gluon_ws_fwd``, ``gluon_ws_bwd``: the warp-specialized forward, dQ and dK/dV
  passes (FA3's producer warp and consumer warp groups), which read the model's layout in place;
  ``gluon_ws_one_pass``: the warp-specialized one-pass backward (dK/dV and dQ's shares, added by the
  copy engine into a float32 accumulator; D from ``triton_bwd.flash_bwd_delta_kernel``);
- ``configs``: tile configs as data (candidates per case class) and tuning keys;
- ``select``: :func:`select.select`, the one pure function that decides which kernel runs each pass (every
  gate: Gluon, descriptors, the one-pass backward, determinism), and the routing rule;
- ``compat``: every private Triton and torch hook, for the versions pinned in pyproject.toml (the only
  module that reads a compiled kernel's internals);
- ``tuner``: :class:`Tuner`, which chooses a config per key by sustained time (host included);
- ``tune_table``: the tuning tables shipped per GPU model (``tuned/*.json``, written by
  ``python -m cs336_systems.cli.flash_tune``), whose keys take their config untimed;
- ``launch``: one launch's arguments per kernel family, and :class:`KernelPlan` (a launch compiled for a
  call signature; its ``fallbacks`` say why it does not launch through the launcher's C entry point);
- ``plan``: :class:`AttentionPlan` per call signature, ``flash_forward`` / ``flash_backward``;
- ``settings``: :class:`FlashSettings`, the ``CS336_FLASH_*`` knobs, and :func:`configured`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources, PTXASError

from . import compat  # checks the Triton and torch versions before any private hook is imported
from .configs import KERNELS, TileConfig, candidate_configs, gpu_candidates, tune_key
from .gluon_bwd import flash_bwd_dkdv_gluon_kernel, flash_bwd_dq_gluon_kernel
from .gluon_fwd import flash_fwd_gluon_kernel
from .gluon_ws_bwd import flash_bwd_dkdv_ws_kernel, flash_bwd_dq_ws_kernel
from .gluon_ws_fwd import flash_fwd_ws_kernel
from .gluon_ws_one_pass import flash_bwd_one_pass_ws_kernel
from .launch import KernelPlan, Launch, dkdv_launch, dq_launch, fwd_launch, one_pass_launches
from .plan import (
    LAUNCHED,
    PLANS,
    AttentionPlan,
    OnePassBackward,
    SplitBackward,
    as_4d,
    attention_plan,
    chosen_configs,
    flash_backward,
    flash_forward,
    launched,
    launched_info,
    new_output,
    tune_space,
)
from .select import Case, KernelChoice, PassChoice, layouts_of, resolve, route_for, select
from .settings import INTERPRET, FlashSettings, configured, flash_settings
from .triton_bwd import flash_bwd_delta_kernel, flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
from .triton_fwd import flash_fwd_kernel
from .tuner import TUNER, Tuner

MAX_HEAD_DIM = 128
# What a candidate that cannot be built for this GPU raises (tuning skips it, keeping the reason).
BUILD_ERRORS = (OutOfResources, CompilationError, PTXASError)


def clear_plans() -> None:
    """Forget every call signature's plan (the next call of each is planned, and tuned, again)."""
    PLANS.clear()


def clear_tuning_cache() -> None:
    """Forget plans, tuning results and what ran."""
    clear_plans()
    TUNER.clear()
    LAUNCHED.clear()


@contextmanager
def forced(kernel: str, config: TileConfig) -> Iterator[None]:
    """Pin ``kernel`` ("fwd", "dq", "dkdv") to ``config`` for a while; plans made before keep the configs
    they were made with, so they are dropped on entry and exit."""
    clear_plans()
    try:
        with TUNER.forcing(kernel, config):
            yield
    finally:
        clear_plans()


def tuning_report() -> dict[str, Any]:
    return TUNER.report()


def config_sources(case: tuple) -> dict[str, str]:
    """Where each kernel's config for ``case`` came from: "tuned", "table", "tune cache"; "forced" or
    "default" (not chosen yet, or tuning off)."""
    return {
        kernel: "forced" if kernel in TUNER.forced else TUNER.source(tune_space(kernel, case)[0])
        for kernel in KERNELS
    }


def candidate_timings(case: tuple) -> dict[str, dict[str, float]]:
    """The tuner's ms per candidate of each kernel for ``case`` = (batch * heads, n_q, n_k, d, causal,
    dtype); empty where it did not tune in this process (a disk-cache hit, a forced config, tuning off)."""
    return {kernel: dict(TUNER.timings.get(tune_space(kernel, case)[0], {})) for kernel in KERNELS}
