"""The choices and defaults the CLIs' parsers show, spelled here in plain Python: the modules that
define them import torch, and ``--help`` should not wait for it. Each value is the library's own
(``tests/test_cli_help.py`` compares them), read here without importing the library."""

from __future__ import annotations

# cs336_systems.model: sorted(PRESETS), BATCH_SIZE
PRESET_NAMES = ("2.7B", "8B", "large", "medium", "small", "tiny", "xl")
BATCH_SIZE = 4

# cs336_systems.profiling: flops.MODES, the names of workload.MODE_ALIASES and of workload.DTYPES
MODES = ("fwd", "fwd_bwd", "train")
MODE_ALIASES = ("forward", "forward+backward", "forward_backward", "fwd+bwd", "step")
DTYPE_NAMES = ("bf16", "fp32")

# cs336_systems.harness.train_step: VARIANTS, OPTIMIZERS
DDP_VARIANTS = (
    "local",
    "naive",
    "flat",
    "individual",
    "bucketed",
    "torch_ddp",
    "fsdp",
    "torch_fsdp2",
    "fsdp_blocks",
    "torch_fsdp2_blocks",
)
DDP_OPTIMIZERS = ("adamw", "sharded", "zero")

# cs336_systems.training.options: sorted(RECIPES), the pieces' choices and StepOptions' defaults
RECIPE_NAMES = ("ours", "torch")
FSDP_CHOICES = ("ours", "torch", "none")
LOSS_CHOICES = ("fused", "chunked", "full")
OPTIMIZER_CHOICES = ("fused_ours", "torch_fused")
STEP_DEFAULTS: dict[str, int | float | str] = {
    "preset": "8B",
    "batch_per_rank": 1,
    "loss_chunk_tokens": 4096,
    "compute_dtype": "bf16",
    "reduce_dtype": "fp32",
    "warmup": 1,
    "steps": 3,
    "course_rep_ms": 30_000,
    "course_warmup_ms": 10_000,
    "cold_start_limit_s": 600.0,
}
