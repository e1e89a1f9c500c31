"""D26 on one GPU (issue 37): the 8B step's per-GPU compute, measured where two GPUs are not to be had.

Group ``proxy_8b`` ("8B per-GPU proxy"): the 8B configuration with CS336_8B_PROXY_LAYERS blocks
(default 4) at CS336_8B_PROXY_SEQ tokens (default 32,768), one sequence, unsharded on one GPU
(``fsdp="none"``: the model computes under bf16 autocast), every block's forward compiled. Rows, in
this order: ``torch`` (SDPA, chunked checkpointed loss, ``AdamW(fused=True)``), ``ours``
(FlashAttention-2, fused LM-head loss, FusedAdamW, attention's output kept in checkpointed blocks), then
``ours`` with one piece swapped for torch's: ``sdpa``, ``chunked_loss``, ``torch_adamw``,
``full_recompute`` (attention re-run in the backward); last ``save_matmuls``, ours with selective
checkpointing that also keeps every matmul's output (an option, not yet the default). ``vs_torch`` is a row's step time over the
``torch`` row's, measured in the same run; ``vs_ours`` the same against ``ours``.

Checkpointing as the two-GPU bench's compiled rows: torch's every block; ours keep:auto's share of the
blocks, i.e. the share the two-GPU 8B step keeps un-checkpointed under this GPU's per-GPU budget
(``training.options.proxy_checkpoint_policy``; CS336_8B_KEEP_BUDGET_GIB sets the budget,
CS336_8B_OURS_CHECKPOINT another policy), so that a gain measured here carries over.

Each row is its own spawned process (clean memory, empty compile and autotune caches, so
``first_step_s`` is every row's cold time to its first step). ``mfu`` is over the bf16 matmul rate
measured in the same process after the timed steps; ``peak_allocated_gib`` the peak over the timed
steps. An out-of-memory row is an OOM row; a row past CS336_8B_PROXY_TIMEOUT_S a ``timeout`` row; a row
not started within the group's CS336_8B_PROXY_BUDGET_S (default 480 s, so the group fits a 10-minute
command) a ``skipped`` row. GPU only: on a CPU every row skips with the reason.

    pytest bench/bench_8b_proxy.py -s --benchmark-json=$OUT/proxy_8b.json
"""

from __future__ import annotations

import time
from typing import Any

import pytest

from cs336_systems.harness.settings import settings
from cs336_systems.harness.step_8b import PROXY_ROWS, proxy_options, record_proxy_skip, run_proxy_row
from cs336_systems.rows.schema import tag

STARTUP_GRACE_S = 60  # a spawn is killed this long after its timeout (launch.spawn's start-up grace)

_group_start: list[float] = []  # when the group's first row started
_measured: dict[str, dict[str, float]] = {}  # row -> step_s and first_step_s of this run


def _row_timeout(benchmark: Any, row: str) -> float | None:
    """This row's spawn timeout within what is left of the group's budget; None (and a skipped row)
    when too little is left to start it."""
    s = settings()
    if not _group_start:
        _group_start.append(time.monotonic())
    left = s.step8b_proxy_budget_s - (time.monotonic() - _group_start[0]) - STARTUP_GRACE_S
    if left < STARTUP_GRACE_S:
        reason = f"the group's budget of {s.step8b_proxy_budget_s:.0f} s (CS336_8B_PROXY_BUDGET_S) was spent"
        record_proxy_skip(benchmark, row, proxy_options(row, s), reason)
        return None
    return min(s.step8b_proxy_timeout_s, left)


@pytest.mark.gpu
@pytest.mark.timeout(900)  # each spawn has its own, shorter limit
@pytest.mark.parametrize("row", list(PROXY_ROWS))
def test_8b_proxy(benchmark, row: str) -> None:
    tag(benchmark, "proxy_8b")
    timeout = _row_timeout(benchmark, row)
    if timeout is None:
        return
    run_proxy_row(benchmark, row, proxy_options(row, settings()), timeout, _measured)
