"""The benches' ``adapters`` rows: another implementation, timed in worker processes of its own code.

``--adapters PATH`` (or ``CS336_ADAPTERS``) adds an ``adapters`` row to the attention, leaderboard, DDP
and sharding benches. The row's code never runs in the bench process (whose ``cs336_systems`` is the
suite's): ``timed`` hands the case to a grading worker (``cs336_systems.grading.worker.timing``), which
loads the student's package and returns the times, and what one call of the timed function ran. A hook
that is not implemented skips the row by name (read from the adapters file's source before any worker
starts). ``standing`` decides, here, whether an attention row may be ranked: a kernel of the repository's
own ran, torch's attention did not, and the time is not below what the GPU's peak allows.
"""

from __future__ import annotations

from typing import Any

import pytest

from cs336_systems.grading.judge import provenance
from cs336_systems.grading.judge.pytest_plugin import PROBE, ROOTS
from cs336_systems.grading.judge.runner import Job, run
from cs336_systems.grading.shared.cases import TRITON_HOOK  # noqa: F401  (the benches' rows name it)

IMPL = "adapters"  # the implementation value of the benches' adapters rows
# An adapters row exists only when an adapters file is given: `adapters_param` marks it with this
# marker and the root conftest drops the marked cases otherwise.
MARKER = "adapters_row"
WORKER_TIMEOUT_S = 1500.0


def row_marks(value: Any, *hooks: str) -> list:
    """The marks of a bench case: for the adapters' value, the row marker naming the hooks the row
    needs (``"a|b"``: either), so that the root conftest drops it without ``--adapters`` and skips it,
    naming the hook, when a hook is not implemented; none for any other value."""
    return [getattr(pytest.mark, MARKER)(*hooks)] if value == IMPL else []


def adapters_param(*values: Any, hooks: tuple[str, ...], id: str = IMPL, gpu: bool = False) -> Any:
    """A bench case of the adapters' implementation (``values`` default to ``"adapters"``); ``gpu``
    marks it GPU-only."""
    marks = row_marks(IMPL, *hooks) + ([pytest.mark.gpu] if gpu else [])
    return pytest.param(*(values or (IMPL,)), marks=marks, id=id)


def timed(config: pytest.Config, task: str, args: dict, world_size: int = 1, backend: str = "gloo") -> dict:
    """Rank 0's result of ``timing.<task>`` run on the adapters' code in worker processes; fails the row
    with the job's one-line problem. The times are the graded process's own report: ``standing`` says
    whether an attention row may be ranked."""
    if task == "ddp" and args.get("bucket_mb") is None:
        probe = config.stash[PROBE]
        args = {
            **args,
            "individual_hook": "get_ddp"
            if probe.reason("get_ddp_individual_parameters")
            else "get_ddp_individual_parameters",
        }
    got = run(
        Job(
            config.stash[ROOTS],
            f"timing.{task}",
            args=args,
            world_size=world_size,
            timeout=WORKER_TIMEOUT_S,
            backend=backend,
        )
    )
    record = got.records.get(("timing", 0))
    problems = [got.job_problem, *got.problems.values()]
    if record is None or record.get("status") != "done" or not isinstance(record.get("result"), dict):
        why = next((p for p in problems if p), record and record.get("message"))
        pytest.fail(f"the adapters' {task} run failed: {why}", pytrace=False)
    return record["result"]


def standing(config: pytest.Config, result: dict, floor_ms: float | None) -> dict[str, Any]:
    """Whether an attention row may be ranked (``grading.judge.provenance.standing``)."""
    folders = [p.resolve() for p in config.stash[ROOTS].folders()]
    return provenance.standing(result.get("provenance"), folders, result.get("mean_ms"), floor_ms)


def workload(on_gpu: bool) -> dict:
    """The MLP the adapters' data-parallel rows train (layers x d -> 4d -> d): about 67M parameters
    on GPUs, a toy on a CPU. Both the student's wrapper and torch's run it in the same ranks."""
    return {"d_model": 1024, "layers": 8, "batch": 16} if on_gpu else {"d_model": 64, "layers": 2, "batch": 8}
