"""Handout answers that combine measured rows with the closed forms of :mod:`cs336_systems.accounting`,
and the Markdown prose of the closed-form answers (accounting returns numbers only). One module per
group of deliverables:

- ``attention``: D5 (activation sizes), D6/D7a (attention memory), D11 (flash speed-ups);
- ``communication``: D17 (DDP overhead model), D18 (XXL accounting), D20 (optimizer sharding);
- ``memory``: D22 (activation checkpointing), D24 (FSDP);
- ``common``: byte units, device capacity, grouping rows by setting.

The closed forms count a model's parameters with torch, so they import ``accounting`` when called:
the measured parts of the report read JSON only and run without torch.
"""

from cs336_systems.report.answers.attention import (
    d6_answer,
    d6_memory_check,
    flash_speedups,
    render_d5,
    render_d6,
    smallest_measured_oom,
)
from cs336_systems.report.answers.common import H100_BYTES, device_capacity_bytes
from cs336_systems.report.answers.communication import (
    allreduce_fit,
    d17_answer,
    d20_answer,
    d20_check,
    render_d17,
    render_d18,
    render_d20,
    spec_allreduce_fit,
)
from cs336_systems.report.answers.memory import (
    best_measured_segment,
    d22_answer,
    d22b,
    d24_answer,
    d24b,
    fitted_block_activations,
    render_d22a,
    render_d24a,
)

__all__ = [
    "H100_BYTES",
    "allreduce_fit",
    "best_measured_segment",
    "d6_answer",
    "d6_memory_check",
    "d17_answer",
    "d20_answer",
    "d20_check",
    "d22_answer",
    "d22b",
    "d24_answer",
    "d24b",
    "device_capacity_bytes",
    "fitted_block_activations",
    "flash_speedups",
    "render_d5",
    "render_d6",
    "render_d17",
    "render_d18",
    "render_d20",
    "render_d22a",
    "render_d24a",
    "smallest_measured_oom",
    "spec_allreduce_fit",
]
