"""Every ``CS336_*`` knob of the benches, read from the environment once, typed and validated.

Benches and harness code call :func:`settings` instead of ``os.environ``; a bad value fails with the
variable's name. Defaults that differ between a GPU machine and a CPU-only one (the DDP bench's model,
steps and traces) are resolved here too, so a bench sees final values.

Not here: ``CS336_FLASH_AUTOTUNE`` (0: no tuning, each kernel's first candidate),
``CS336_FLASH_TUNE_CACHE`` (a JSON file of tuning results kept across processes),
``CS336_FLASH_TUNE_TABLE`` (0: ignore the tuning table shipped for this GPU model) and
``CS336_FLASH_COMPILE_THREADS``, read once by ``kernels/flash/settings.py`` into a ``FlashSettings`` (a
kernel module may not import the harness); code changes them for a while with
``kernels.flash.configured(...)``.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T", int, float)


def _str(env: Mapping[str, str], name: str, default: str | None) -> str | None:
    value = env.get(name, "").strip()
    return value or default


def _number(env: Mapping[str, str], name: str, default: T, cast: Callable[[str], T]) -> T:
    value = _str(env, name, None)
    if value is None:
        return default
    try:
        return cast(value)
    except ValueError:
        what = "an integer" if cast is int else "a number"
        raise ValueError(f"environment variable {name} must be {what}, got {value!r}") from None


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    return _number(env, name, default, int)


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    value = _int(env, name, default)
    if value < 1:
        raise ValueError(f"environment variable {name} must be a positive integer, got {value}")
    return value


def _float(env: Mapping[str, str], name: str, default: float) -> float:
    return _number(env, name, default, float)


def _list(env: Mapping[str, str], name: str, default: str) -> tuple[str, ...]:
    return tuple(v.strip() for v in (_str(env, name, default) or "").split(",") if v.strip())


def _keep_list(env: Mapping[str, str], name: str, default: str) -> tuple[str, ...]:
    """Blocks to keep un-checkpointed: integers >= 0 or "auto"."""
    values = _list(env, name, default)
    bad = [v for v in values if v != "auto" and not v.isdigit()]
    if bad or not values:
        raise ValueError(f"environment variable {name} must list integers >= 0 or 'auto', got {values}")
    return values


def _step_checkpoint(env: Mapping[str, str], name: str, default: str) -> str:
    from cs336_systems.training.step_8b import validate_step_checkpoint

    value = _str(env, name, default) or default
    try:
        validate_step_checkpoint(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {name}: {exc}") from None
    return value


@dataclass(frozen=True)
class Settings:
    """The bench knobs (docs/gpu-benchmarks.md, "Knobs"); field ``x_y`` is variable ``CS336_X_Y``."""

    # bench_model.py: compile every model case, not only the must-show ones (~1 min of compile each)
    full_grid: bool = False
    # bench_allreduce.py: largest gloo message in MiB (10: a laptop stays fast; 1024: the full table)
    gloo_max_mb: float = 10.0
    # bench_attention.py: forward+backward passes per D6 case on a GPU
    d6_passes: int = 100
    # bench_flash.py: do_bench budgets (ms) of the sweep and the leaderboard case; naive seq cap
    do_bench_warmup_ms: int = 10
    do_bench_rep_ms: int = 50
    leaderboard_warmup_ms: int = 200
    leaderboard_rep_ms: int = 2000
    naive_max_seq: int = 65536
    # bench_flash.py attention shapes: interleaved rounds per (shape, impl, pass), 10 ms of reps each
    shape_rounds: int = 5
    # tests: start the one-node Slurm cluster (scripts/slurm_local.sh) for the Slurm tests when none runs
    slurm: bool = False
    # the attention benches append every finished row to this JSONL file (None: no log)
    bench_jsonl: str | None = None
    # bench_ddp.py / bench_sharding.py: model, shapes, steps and traces of the training step
    ddp_size: tuple[str, ...] = ("tiny",)
    ddp_ctx: int = 32
    ddp_batch: int = 4  # global batch
    ddp_dtypes: tuple[str, ...] = ("fp32",)
    ddp_world_sizes: tuple[int, ...] = (2,)
    ddp_warmup: int = 1
    ddp_steps: int = 3
    ddp_profile_steps: int = 0  # 0: no profiled step
    trace_dir: str | None = None  # rank 0's Chrome traces go here...
    trace_variants: tuple[str, ...] = ("naive", "individual")  # ...for these DDP variants
    # bench_leaderboard_2026.py: the 8B step (D26); on a CPU-only machine every case skips
    step8b_steps: int = 3  # timed steps per case (after the first step; main group)
    step8b_ablation_steps: int = 2  # timed steps per ablation case
    step8b_ablation_compile: bool = False  # ablation rows eager (False) or block-compiled (True)
    step8b_timeout_s: float = 240.0  # per case (eager); a compiled case gets twice as long
    step8b_profile: bool = True  # one profiled step of each compiled case (kernel time by category)
    step8b_ours_checkpoint: str = "keep:auto"  # the compiled "ours" rows' (main and ablation) policy
    step8b_keep: tuple[str, ...] = ("0", "auto")  # the keep ablation: one row per N ("auto": keep:auto)
    step8b_keep_budget_gib: float | None = None  # keep:auto's budget (None: 80% of the GPU)
    # The main group's compiled rows also time the course's way: do_bench(rep, warmup) mean
    step8b_course: bool = False
    step8b_course_rep_ms: int = 30_000  # the course's values
    step8b_course_warmup_ms: int = 10_000
    # bench_8b_proxy.py: the 8B step's per-GPU proxy on one GPU (L blocks, unsharded, compiled blocks)
    step8b_proxy_layers: int = 4
    step8b_proxy_seq: int = 32768
    step8b_proxy_steps: int = 3  # timed steps per row (after the first step and one warm-up step)
    step8b_proxy_budget_s: float = 480.0  # the group's wall time: a row not started by then is a not-run row
    step8b_proxy_timeout_s: float = 180.0  # per row (its spawn is killed 60 s of start-up grace later)

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None, on_gpu: bool | None = None) -> Settings:
        """Read ``env`` (default ``os.environ``); ``on_gpu`` (default: CUDA present) picks the defaults
        of the DDP benches: the handout's xl / ctx 512 / 3+10 steps with a profiled step and traces on
        GPUs, a seconds-long tiny run on gloo otherwise."""
        env = os.environ if env is None else env
        gpu = torch.cuda.is_available() if on_gpu is None else on_gpu
        world_sizes = _list(env, "CS336_DDP_WORLD_SIZES", "2")
        try:
            ws = tuple(int(w) for w in world_sizes)
        except ValueError:
            raise ValueError(f"CS336_DDP_WORLD_SIZES must be integers, got {world_sizes}") from None
        return cls(
            full_grid=_str(env, "CS336_FULL_GRID", "0") == "1",
            gloo_max_mb=_float(env, "CS336_GLOO_MAX_MB", 10.0),
            d6_passes=_int(env, "CS336_D6_PASSES", 100),
            do_bench_warmup_ms=_int(env, "CS336_DO_BENCH_WARMUP_MS", 10),
            do_bench_rep_ms=_int(env, "CS336_DO_BENCH_REP_MS", 50),
            leaderboard_warmup_ms=_int(env, "CS336_LEADERBOARD_WARMUP_MS", 200),
            leaderboard_rep_ms=_int(env, "CS336_LEADERBOARD_REP_MS", 2000),
            naive_max_seq=_int(env, "CS336_NAIVE_MAX_SEQ", 65536),
            shape_rounds=_int(env, "CS336_SHAPE_ROUNDS", 5),
            slurm=_str(env, "CS336_SLURM", "0") == "1",
            bench_jsonl=_str(env, "CS336_BENCH_JSONL", None),
            ddp_size=_list(env, "CS336_DDP_SIZE", "xl" if gpu else "tiny"),
            ddp_ctx=_int(env, "CS336_DDP_CTX", 512 if gpu else 32),
            ddp_batch=_int(env, "CS336_DDP_BATCH", 4),
            ddp_dtypes=_list(env, "CS336_DDP_DTYPES", "fp32"),
            ddp_world_sizes=ws,
            ddp_warmup=_int(env, "CS336_DDP_WARMUP", 3 if gpu else 1),
            ddp_steps=_int(env, "CS336_DDP_STEPS", 10 if gpu else 3),
            ddp_profile_steps=_int(env, "CS336_DDP_PROFILE_STEPS", 1 if gpu else 0),
            # git-ignored: two traces are 3 MB, more than docs/results may hold (tests/test_results_folder.py)
            trace_dir=_str(env, "CS336_TRACE_DIR", "runs/traces" if gpu else None),
            trace_variants=_list(env, "CS336_TRACE_VARIANTS", "naive,individual"),
            step8b_steps=_int(env, "CS336_8B_STEPS", 3),
            step8b_ablation_steps=_int(env, "CS336_8B_ABLATION_STEPS", 2),
            step8b_ablation_compile=_str(env, "CS336_8B_ABLATION_COMPILE", "0") == "1",
            step8b_timeout_s=_float(env, "CS336_8B_TIMEOUT_S", 240.0),
            step8b_profile=_str(env, "CS336_8B_PROFILE", "1") == "1",
            step8b_ours_checkpoint=_step_checkpoint(env, "CS336_8B_OURS_CHECKPOINT", "keep:auto"),
            step8b_keep=_keep_list(env, "CS336_8B_KEEP", "0,auto"),
            step8b_keep_budget_gib=_float(env, "CS336_8B_KEEP_BUDGET_GIB", 0.0) or None,  # 0: default
            step8b_course=_str(env, "CS336_8B_COURSE", "0") == "1",
            step8b_course_rep_ms=_positive(env, "CS336_8B_COURSE_REP_MS", 30_000),
            step8b_course_warmup_ms=_positive(env, "CS336_8B_COURSE_WARMUP_MS", 10_000),
            step8b_proxy_layers=_positive(env, "CS336_8B_PROXY_LAYERS", 4),
            step8b_proxy_seq=_positive(env, "CS336_8B_PROXY_SEQ", 32768),
            step8b_proxy_steps=_positive(env, "CS336_8B_PROXY_STEPS", 3),
            step8b_proxy_budget_s=_float(env, "CS336_8B_PROXY_BUDGET_S", 480.0),
            step8b_proxy_timeout_s=_float(env, "CS336_8B_PROXY_TIMEOUT_S", 180.0),
        )


@functools.cache
def settings() -> Settings:
    """The process's settings, read on first use (not at import) and then fixed."""
    return Settings.from_env()
