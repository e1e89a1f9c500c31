"""Whether a timing measured the case or the machine's load: the facts a row records about its
machine (load average against cores, the spread of its rounds) and the one judgement, shared by the
benches, the benchmark CLI and the report (which marks such rows instead of printing them).

Plain Python, no torch: the report imports it to judge rows it reads from JSON.

Why these three, and in this order: the spread of the rounds is the row's own evidence, so it
decides first. Rounds that agree (``TIGHT`` or better over ``TIGHT_ROUNDS`` or more) are a result
even on a loaded machine: the load average counts every runnable process, including ones that never
touched this row's cores (``OMP_NUM_THREADS=1`` runs beside them), and condemning such rows flagged
all of a busy machine's output (issue 51). Rounds spread beyond ``SPREAD`` are never a result. In
between, or with too few rounds to tell, the load average decides: on a shared CPU a whole run can
read slower evenly, which only the load shows. An MFU above 100% is impossible, so the rate it
divides by (the matmul rate, measured separately) and the step's time saw different loads.
A GPU row whose call took the host longer to issue than the device to run (``host_bound``) is judged
by the load like a CPU row: its device time is the host's issue rate.

The spread is robust (median absolute deviation) so that one cold round does not condemn a row, but the
tables print mean ± stddev, which one such round carries: a D11 row read "0.798 ± 2.791" as a result
beside withheld neighbours (issue 73). A stddev above its mean (``SCATTERED``) is therefore no result
either: of the row when its mean is its result (a row with no do_bench median, or one whose do_bench
timed the same loaded host), else of that figure alone (``scattered``). A row with no warm-up whose
slowest round is its first measured its cold start on purpose (D2's warm-up study) and stands.
"""

from __future__ import annotations

import math
import os
import statistics
from collections.abc import Mapping, Sequence
from typing import TypeGuard

LOAD_PER_CORE = 1.5  # runnable processes per core (1-minute average) above which a CPU row is unreliable
SPREAD = 0.25  # median absolute deviation / median of the rounds above which a row is unreliable
MIN_ROUNDS = 3  # fewer rounds say nothing about their spread
TIGHT = 0.10  # rounds agreeing this well (median absolute deviation / median) are a result under load
TIGHT_ROUNDS = 5  # ... when there are at least this many of them
SCATTERED = 1.0  # stddev / mean of a figure above which it is no result: its ± reaches below zero


def machine_load() -> dict[str, float]:
    """The 1-minute load average and the core count, when the OS tells them."""
    cores = os.cpu_count()
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return {"cpu_cores": float(cores)} if cores else {}
    return {"load_avg_1m": load, **({"cpu_cores": float(cores)} if cores else {})}


def rounds_spread(times: Sequence[float]) -> float | None:
    """Median absolute deviation / median of the timed rounds (None for fewer than MIN_ROUNDS or a
    zero median). Robust on purpose: one cold first step (D2's warm-up rows measure exactly that)
    barely moves it, while rounds disturbed throughout do."""
    if len(times) < MIN_ROUNDS:
        return None
    median = statistics.median(times)
    return statistics.median(abs(t - median) for t in times) / median if median > 0 else None


def contention_facts(times: Sequence[float]) -> dict[str, float]:
    """What a row records next to its timing (``extra_info``)."""
    spread = rounds_spread(times)
    facts = {**machine_load(), "rounds_n": float(len(times))}
    return {**facts, **({"rounds_spread": spread} if spread is not None else {})}


def rounds_agree(values: Mapping[str, float]) -> bool:
    """Whether the row's rounds agree well enough to stand as a result whatever the load (rows
    written before ``rounds_n`` was recorded never do: nothing says how many rounds they had)."""
    spread, n = values.get("rounds_spread"), values.get("rounds_n")
    if spread is None or n is None or math.isnan(spread):
        return False
    return n >= TIGHT_ROUNDS and spread <= TIGHT


def _number(value: object) -> float | None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)
    return float(value) if ok else None


def cold_start(values: Mapping[str, object]) -> bool:
    """Whether a row without warm-up had its first round as its slowest: the cold start D2's warm-up
    study measures on purpose, so the spread it gives the mean is the result, not a disturbance."""
    first, slowest = _number(values.get("first_ms")), _number(values.get("max_ms"))
    return (
        _number(values.get("warmup")) == 0 and first is not None and slowest is not None and first >= slowest
    )


def scattered(mean: object, std: object) -> str | None:
    """Why a figure printed as ``mean ± std`` is no result (its stddev is above ``SCATTERED`` x the
    mean: a few rounds far off the rest carry the mean), or None."""
    mean, std = _number(mean), _number(std)
    if mean is None or std is None or mean <= 0 or std <= SCATTERED * mean:
        return None
    return f"rounds' stddev {std / mean:.2g}× their mean"


def _scattered_result(values: Mapping[str, object], on_cpu: bool) -> str | None:
    """``scattered`` for the row's mean when it is the row's result: no do_bench median, or a do_bench
    median timed by the same host's clock (``on_cpu``). A device-timed do_bench row keeps its result;
    its host-timed cells are marked one by one (the report's ``figure_verdict``)."""
    if (not on_cpu and "do_bench_ms" in values) or cold_start(values) or values.get("rounds_n") == 1:
        return None
    if "mean_ms" in values:
        return scattered(values.get("mean_ms"), values.get("std_ms"))
    return scattered(values.get("stats_mean_ms"), values.get("stats_std_ms"))


def contention_reasons(values: Mapping[str, float], on_cpu: bool) -> list[str]:
    """Why a row's timing is not a result, from its recorded values; [] when nothing says so. The
    load average counts only for rows timed on the host (``on_cpu``: see ``host_timed``; a GPU's time
    does not share the host's cores the same way), and only when the rounds do not agree on their own
    (module docstring): one round never does, it has no spread."""
    reasons = []
    load, cores = values.get("load_avg_1m"), values.get("cpu_cores")
    loaded = on_cpu and load is not None and cores and load / cores > LOAD_PER_CORE
    if loaded and not rounds_agree(values):
        reasons.append(
            f"load average {load:.3g} on {cores:g} cores" + (", host-bound" if host_bound(values) else "")
        )
    spread = values.get("rounds_spread")
    if spread is not None and not math.isnan(spread) and spread > SPREAD:
        reasons.append(f"rounds spread ±{spread:.0%}")
    elif why := _scattered_result(values, on_cpu):
        reasons.append(why)
    mfu = values.get("mfu")
    if mfu is not None and mfu > 1.0:
        reasons.append(f"MFU {mfu:.0%} is above 100%: the step and the matmul rate saw different loads")
    return reasons


# The suite's Triton pieces by the names rows give them: an impl or attention naming Triton, the fused
# LM-head loss ("fused"; torch's own AdamW(fused=True) rows are "torch_fused"), the model's fused-loss
# flag, and the 8B step's pieces (training.options.TRITON_PIECES; a test holds the two together).
INTERPRETER_NOTE = (
    "a Triton kernel timed on a CPU ran under TRITON_INTERPRET=1 (Triton's interpreter, run for "
    "correctness): not a performance figure, and no ratio is derived from it"
)
TRITON_PIECE_VALUES = {"impl": "fused", "loss": "fused", "optimizer": "fused_ours"}


def interpreted(descriptors: Mapping[str, object], on_cpu: bool) -> bool:
    """Whether a row timed one of the suite's Triton kernels on a CPU, which only Triton's interpreter
    runs: D12's "ours / best SDPA" of 670x and D26's fused AdamW at 2,144x torch were such rows (issue 51).
    ``descriptors`` holds the row's parameters and fields, booleans included (``fused_loss``: the
    model's loss through the fused kernel), and an 8B step row's ``pieces`` mapping is read too."""
    if not on_cpu:
        return False
    pieces = descriptors.get("pieces")
    if isinstance(pieces, Mapping) and interpreted(pieces, on_cpu):
        return True
    names = [str(descriptors.get(k, "")) for k in ("impl", "attention", "variant", "recipe")]
    return (
        any("triton" in n for n in names)
        or any(descriptors.get(k) == v for k, v in TRITON_PIECE_VALUES.items())
        or descriptors.get("fused_loss") is True
    )


# A do_bench row (bench_flash) carries two timers: ``do_bench_ms``, its result, and pytest-benchmark's
# host-timed rounds (``median_ms``, the terminal table's columns). A host round adds launch and
# synchronize overhead; across docs/results it stays inside both bounds below, the ratio coming closest on
# the shortest kernels (docs/perf-notes.md, "what a new user of the report and the CLIs hit", "Two timers
# on one row"). Timers further apart than both bounds measured different things (issue 57: a CPU row's
# rounds read 216 ms against do_bench's 0.178 ms).
TIMERS_APART = 10.0
TIMER_OVERHEAD_MS = 2.0
TIMERS_NOTE = "its two timers disagree"


def timers_disagree(values: Mapping[str, object]) -> str | None:
    """Why a row's host-timed figures (pytest-benchmark's) are not its result, when they are orders of
    magnitude away from its ``do_bench_ms``, which is; None when they agree or the row has one timer."""
    result, host = values.get("do_bench_ms"), values.get("median_ms")
    numbers = [v for v in (result, host) if isinstance(v, int | float) and not isinstance(v, bool) and v > 0]
    if len(numbers) < 2:
        return None
    ratio = max(numbers) / min(numbers)
    if ratio < TIMERS_APART or abs(host - result) < TIMER_OVERHEAD_MS:
        return None
    return (
        f"{TIMERS_NOTE} {ratio:,.0f}×: pytest-benchmark's host-timed rounds have a median of {host:.3g} ms, "
        f"do_bench {result:.3g} ms. The row's result is its do_bench median (the report's `do_bench "
        "median` column); the host-timed figures (mean and median here, pytest-benchmark's Min/Mean/Median) are not a result"
    )


def verdict_label(why: str) -> str:
    """The mark a row's verdict puts in place of its figure (tables, the CLI, the bench terminal table)."""
    if why.startswith(TIMERS_NOTE):
        return "timers disagree"
    return "interpreted" if why == INTERPRETER_NOTE else "unreliable"


def _positive(value: object) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and value > 0


def host_bound(values: Mapping[str, object]) -> bool:
    """Whether issuing one call (``launch_ms``: profiling.timing.launch_time) took the host at least as
    long as the device took to run it (``do_bench_ms``): the device then waited on the host between
    calls, and its timer measured the host's issue rate. Rows without launch_ms: False."""
    launch, device = values.get("launch_ms"), values.get("do_bench_ms")
    return _positive(launch) and _positive(device) and launch >= device


def host_timed(device_name: str, values: Mapping[str, object]) -> bool:
    """Whether the host's load bears on a row's time: a CPU row, a row that names no device, or a
    host-bound GPU row (its figure is the host's issue rate: :func:`host_bound`). The grader's own rows
    (bench_grading) time whole processes by the host's wall clock and name no device: read as GPU rows,
    one round at a load of 6.33 on 2 cores printed as a result."""
    name = device_name.strip().lower()
    return not name or name.startswith("cpu") or host_bound(values)


def row_verdict(extra_info: Mapping[str, object], params: Mapping[str, object] | None = None) -> str | None:
    """The verdict on one pytest-benchmark row from its JSON fields (the bench terminal table's mark;
    the report judges its parsed rows with the same two functions): None for a result."""
    device = str(extra_info.get("device_name") or "")
    if interpreted({**extra_info, **(params or {})}, device.lower().startswith("cpu")):
        return INTERPRETER_NOTE
    numbers = {
        k: float(v) for k, v in extra_info.items() if isinstance(v, int | float) and not isinstance(v, bool)
    }
    return "; ".join(contention_reasons(numbers, host_timed(device, numbers))) or None
