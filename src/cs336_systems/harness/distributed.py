"""Glue between multi-process measurements and pytest-benchmark, shared by the distributed benches.

The timing happens inside the spawned ranks; the benchmark fixture lives in the parent. So the
parent runs one spawn per group of cases (e.g. every DDP variant of one model size: the start-up
and the process group are paid once) and then records each case with ``harness.record.record_times``, which
hands the ranks' measured per-step times to pytest-benchmark as its rounds: the JSON's ``stats``
(mean, stddev, min, max, rounds) are those steps, and ``extra_info`` carries the same figures as
``mean_ms`` / ``std_ms`` / ``median_ms`` plus everything the writeup tables need.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Hashable
from typing import Any

import pytest
import torch

from cs336_systems.distributed.launch import spawn
from cs336_systems.distributed.process_group import default_backend
from cs336_systems.harness.environment import device_name
from cs336_systems.harness.settings import settings
from cs336_systems.harness.train_step import TrainCase, TrainSetup, combine_ranks, run_cases
from cs336_systems.rows.schema import tag


def selected_params(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    """Parametrize values of the test cases of the requesting module that survived selection
    (``-k``, ``--only``, deselection) and are not skipped, so a group's spawn runs only what will
    be recorded."""
    return [
        dict(item.callspec.params)
        for item in request.session.items
        if getattr(item, "module", None) is request.module
        and hasattr(item, "callspec")
        and item.get_closest_marker("skip") is None
    ]


class GroupedRuns:
    """``runs(group, case)`` -> the result of ``case``, running ``launch(group, cases)`` once per
    group for all the cases of that group; a group whose spawn failed fails each of its cases with
    the same error instead of spawning again."""

    def __init__(
        self, launch: Callable[[Hashable, list[Hashable]], dict], cases_of: Callable[[Hashable], list]
    ):
        self._launch = launch
        self._cases_of = cases_of
        self._done: dict[Hashable, dict | BaseException] = {}

    def __call__(self, group: Hashable, case: Hashable) -> Any:
        if group not in self._done:
            try:
                self._done[group] = self._launch(group, self._cases_of(group))
            except Exception as exc:
                self._done[group] = exc
        result = self._done[group]
        if isinstance(result, BaseException):
            raise RuntimeError(f"the spawn for {group} failed: {result}") from result
        return result[case]

    def get(self, group: Hashable, case: Hashable) -> Any | None:
        """The result if ``case`` was selected (and so run) in ``group``, else None."""
        if case not in self._cases_of(group):
            return None
        return self(group, case)


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def backend_device_name(backend: str) -> str:
    """The machine a spawn on ``backend`` runs on: GPU 0 for nccl, the host for gloo."""
    return device_name("cuda" if backend == "nccl" and torch.cuda.is_available() else "cpu")


def gpu_skip_reason(world_size: int) -> str | None:
    """On a GPU machine each rank needs its own GPU; a CPU-only machine runs gloo instead."""
    have = cuda_count()
    if have and have < world_size:
        return f"needs {world_size} GPUs (one per rank); {have} present"
    return None


# -- the DDP / sharding benches ------------------------------------------------------------------


def train_setup(size: str, ctx: int, dtype: str) -> TrainSetup:
    """Bench defaults (``harness.settings``): on GPUs the handout's standard configuration (xl, context
    512, global batch 4 = 2 per rank on 2 GPUs, fp32, AdamW); on a CPU-only machine a seconds-long gloo
    smoke run. CS336_DDP_BATCH / _WARMUP / _STEPS / _PROFILE_STEPS, CS336_TRACE_DIR and
    CS336_TRACE_VARIANTS (rank 0's Chrome traces; default naive,individual: the handout's screenshots)."""
    s = settings()
    return TrainSetup(
        preset=size,
        context_length=ctx,
        global_batch=s.ddp_batch,
        dtype=dtype,
        warmup=s.ddp_warmup,
        steps=s.ddp_steps,
        profile_steps=s.ddp_profile_steps,
        trace_dir=s.trace_dir,
        trace_variants=s.trace_variants,
    )


def spawn_train_cases(
    setup: TrainSetup, world_size: int, cases: list[TrainCase], timeout: float
) -> dict[TrainCase, dict]:
    """One spawn running ``cases`` in turn; per case the numbers combined over ranks."""
    per_rank = spawn(run_cases, world_size, setup, cases, timeout=timeout)
    return {case: combine_ranks([r[case.key] for r in per_rank]) for case in cases}


def train_extra_info(
    result: dict[str, Any], setup: TrainSetup, world_size: int, backend: str
) -> dict[str, Any]:
    """extra_info of one recorded case: the combined figures and the setup they were taken in."""
    info = {k: v for k, v in result.items() if k != "times_ms"}
    info.update(
        preset=setup.preset,
        ctx=setup.context_length,
        global_batch=setup.global_batch,
        warmup_steps=max(setup.warmup, 1) + 1,  # as run: at least one, plus the untimed memory step
        timed_steps=setup.steps,
        param_dtype="fp32",
        autocast="bf16" if setup.dtype == "bf16" else None,
        backend=backend,
        world_size=world_size,
        device_name=backend_device_name(backend),
    )
    return info


def train_runs(
    request: pytest.FixtureRequest,
    case_of: Callable[[dict[str, Any]], TrainCase],
    timeout_s: float,
    **setup_changes: Any,
) -> GroupedRuns:
    """The module-scoped runner of a training bench: one spawn per (size, ctx, dtype, world_size)
    runs every selected case of that group; ``case_of`` turns a case's params into a ``TrainCase`` and
    ``setup_changes`` override fields of the group's ``TrainSetup``; each spawn gets ``timeout_s``."""
    selected = [p for p in selected_params(request) if gpu_skip_reason(p["world_size"]) is None]

    def cases_of(group: tuple) -> list[TrainCase]:
        return [case_of(p) for p in selected if (p["size"], p["ctx"], p["dtype"], p["world_size"]) == group]

    def launch(group: tuple, cases: list[TrainCase]) -> dict:
        size, ctx, dtype, world_size = group
        setup = dataclasses.replace(train_setup(size, ctx, dtype), **setup_changes)
        return spawn_train_cases(setup, world_size, cases, timeout_s)

    return GroupedRuns(launch, cases_of)


def run_train_case(
    benchmark: Any,
    runs: GroupedRuns,
    group_key: str,
    case: TrainCase,
    size: str,
    ctx: int,
    dtype: str,
    world_size: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The shared start of every training bench case: name the group, skip with a reason where the
    GPUs are missing, run (or fetch) the case's spawn group, and build its extra_info.
    Returns ``(result, info)``; the caller adds its own fields and records the row."""
    tag(benchmark, group_key)
    reason = gpu_skip_reason(world_size)
    if reason:
        pytest.skip(reason)
    result = runs((size, ctx, dtype, world_size), case)
    info = train_extra_info(result, train_setup(size, ctx, dtype), world_size, default_backend(world_size))
    return result, info
