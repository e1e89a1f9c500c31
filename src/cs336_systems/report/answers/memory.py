"""Answers about activation memory and sharding of the 2026 parts: checkpointing (D22) and FSDP
(D24), each a closed form next to the measured rows of its bench."""

from __future__ import annotations

import math

from cs336_systems.report.answers.common import MiB, _mib, _settings
from cs336_systems.report.load import Record, derived_from, not_quoted, rows_of, unreliable
from cs336_systems.report.tables import format_number

D22_COMMAND = "`pytest bench/bench_memory.py -k checkpointing --benchmark-json=OUT.json` (1 GPU)"
D24_COMMAND = "`pytest bench/bench_fsdp.py --benchmark-json=OUT.json` (2 GPUs)"


def _policy(r: Record) -> str:
    return str(r.descriptors.get("policy", r.texts.get("checkpoint", "")))


def _step_ms(r: Record) -> float | None:
    return r.values.get("median_ms", r.values.get("mean_ms"))


def _every_k(policy: str) -> int | None:
    head, _, k = policy.partition(":")
    return int(k) if head == "every" and k.isdigit() else None


def best_measured_segment(rows: list[Record]) -> tuple[int, dict[int, float]] | None:
    """(k, {k: peak MiB}) for the "every:k" rows of one setting that ran: k with the lowest peak."""
    peaks = {
        k: r.values["peak_memory_mib"]
        for r in rows
        if (k := _every_k(_policy(r))) is not None
        and not r.oom
        and not r.skipped
        and "peak_memory_mib" in r.values
    }
    return (min(peaks, key=peaks.__getitem__), peaks) if peaks else None


def fitted_block_activations(peaks: dict[int, float], n_blocks: int, unit_mib: float) -> float | None:
    """c of the accounting's peak = ceil(N/k) + k·c (in block inputs), least squares over the measured
    every:k peaks (with a free constant for weights, optimizer state and logits)."""
    if len(peaks) < 2:
        return None
    xs = [k * unit_mib for k in peaks]
    ys = [p - math.ceil(n_blocks / k) * unit_mib for k, p in peaks.items()]
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else None


def render_d22a(n_blocks: int = 48) -> str:
    from cs336_systems.accounting import checkpointing as ckpt

    a = ckpt.d22a(n_blocks)
    none = ckpt.no_checkpointing(n_blocks)
    rows = [
        f"| {p.strategy} | {p.stored_inputs} + {p.live_blocks}·c = {p.peak_units(1):g} | O({p.memory_order}) | "
        f"{p.extra_block_forwards} | {p.compute_ratio():.2f}× | O({p.compute_order}) |"
        for p in (none, a.sqrt_n, a.log_n)
    ]
    return "\n".join(
        [
            f"**(a)** For N identical blocks (xl: N = {n_blocks}), memory in block inputs (one residual-stream "
            "tensor) with c such units saved inside one block, compute in block forwards (a backward ≈ 2):",
            "",
            "| strategy | peak activations at c = 1 | memory | recomputed block forwards | step compute | compute |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
            f"Single level (checkpoint every k blocks) keeps ceil(N/k) inputs plus one segment's k blocks: "
            f"ceil(N/k) + k·c, smallest at k ≈ √(N/c) (k = {a.sqrt_n.live_blocks} for N = {n_blocks}, c = 1): "
            f"**O(√N) memory for one extra forward per block, O(N) compute ({a.sqrt_n.compute_ratio():.2f}× "
            "the step)**. The memory-optimal strategy checkpoints recursively (halve the stack, checkpoint "
            f"each half, recurse): one stored input per level, ceil(log2 N) + 1 = {a.log_n.stored_inputs}, and "
            f"one block live: **O(log N) memory, O(N log N) compute** (each block recomputed once per level, "
            f"{a.log_n.extra_block_forwards} extra block forwards, {a.log_n.compute_ratio():.2f}× the step).",
        ]
    )


def d22b(records: list[Record]) -> str:
    from cs336_systems.accounting import checkpointing as ckpt
    from cs336_systems.accounting import parameter_numels
    from cs336_systems.model import PRESETS

    rows = rows_of(records, "checkpointing")
    lines = []
    for (device, size, ctx, batch, dtype), group in sorted(
        _settings(rows, "size", "ctx", "batch", "dtype").items(), key=str
    ):
        best = best_measured_segment(group)
        if best is None:
            continue
        k, peaks = best
        by_policy = {_policy(r): r for r in group if not r.oom and not r.skipped}
        ks = sorted(peaks)
        i = ks.index(k)
        near = ", ".join(
            f"every:{j} {format_number('mib', peaks[j])} MiB" for j in ks[max(0, i - 1) : i + 2] if j != k
        )
        text = (
            f"On {device} ({size}, ctx {ctx}, batch {batch}, {dtype}): **the lowest peak of a single level is "
            f"every:{k}, {format_number('mib', peaks[k])} MiB** (neighbours: {near or 'none measured'})"
        )
        config = PRESETS.get(str(size))
        if config is not None and "params" in group[0].values:  # a preset with layers overridden is not it
            config = config if group[0].values["params"] == sum(parameter_numels(config)) else None
        n = config.num_layers if config is not None else k
        best_ms, none = _step_ms(by_policy[f"every:{k}"]), by_policy.get("none")
        if none is not None and (why := derived_from(by_policy[f"every:{k}"], none)):
            text += f"; its step time against no checkpointing: {why}"
        elif none is not None and "peak_memory_mib" in none.values and best_ms and _step_ms(none):
            text += (
                f"; without checkpointing {format_number('mib', none.values['peak_memory_mib'])} MiB. It costs "
                f"{best_ms / _step_ms(none):.2f}× the step time ({best_ms:.0f} vs {_step_ms(none):.0f} ms; the "
                f"accounting's one extra forward per block: {ckpt.single_level(n, k).compute_ratio():.2f}×)"
            )
        nested = by_policy.get("nested")
        if nested is not None and "peak_memory_mib" in nested.values:
            text += f"; nested: {format_number('mib', nested.values['peak_memory_mib'])} MiB"
            if _step_ms(nested) and not unreliable(nested):  # a step time its table marks is no figure
                text += f" at {_step_ms(nested):.0f} ms"
        if config is not None and ctx is not None and batch is not None:
            unit = int(batch) * int(ctx) * config.d_model * 4 / MiB  # the fp32 residual stream (autocast too)
            c = fitted_block_activations(peaks, n, unit)
            if c is not None and c > 0:
                text += (
                    f". Fitting ceil(N/k) + k·c to these peaks (N = {n}, block input {unit:.1f} MiB) gives "
                    f"c ≈ {c:.0f}: a block saves far more than its input, so √(N/c) ≈ {math.sqrt(n / c):.1f} and "
                    f"the accounting's best single level is {ckpt.best_single_level(n, c).strategy}"
                )
        lines.append(text + ".")
    if not lines:
        return _d22b_without_peaks(rows)
    return "\n\n".join(["**(b)** Measured (peak memory per step, step time median):", *lines])


def _d22b_without_peaks(rows: list[Record]) -> str:
    """(b) when no single-level row has a peak: either there are no rows, or they were timed where
    the allocator reports no peak (CPU), and then the step times are what there is to compare."""
    if not rows:
        return f"**(b)** No measured checkpointing rows in the given JSON; {D22_COMMAND} produces them."
    ran = [r for r in rows if not r.oom and not r.skipped and _step_ms(r)]
    # one verdict per row: the step time of a row its table marks is not quoted as a result
    times = ", ".join(f"{_policy(r)} {format_number('ms', _step_ms(r))} ms" for r in ran if not unreliable(r))
    left_out = not_quoted(ran, _policy)
    return (
        f"**(b)** The {len(rows)} measured checkpointing row(s) above carry no peak memory (the device "
        f"reports none, e.g. a CPU), so no segment length can be picked from memory; step times: "
        f"{times or ('none is a result' if ran else 'none timed')}{'; ' + left_out if left_out else ''}. "
        f"{D22_COMMAND} on a GPU measures the peaks."
    )


def d22_answer(records: list[Record]) -> str:
    from cs336_systems.model import PRESETS

    return "\n\n".join([render_d22a(PRESETS["xl"].num_layers), d22b(records)])


def render_d24a(world_size: int = 2) -> str:
    from cs336_systems.accounting import fsdp as fsdp_accounting

    rows = []
    for dtype, nbytes in (("bf16", 2), ("fp32", 4)):
        s = fsdp_accounting.fsdp_saving("xl", world_size, compute_bytes=nbytes)
        rows.append(
            f"| {dtype} | {_mib(s.ddp_state_bytes)} | {_mib(s.fsdp_state_bytes)} | {_mib(s.working_set_bytes)} | "
            f"**{_mib(s.saving_bytes)}** | {s.saving_share:.1%} |"
        )
    s = fsdp_accounting.fsdp_saving("xl", world_size)
    return "\n".join(
        [
            f"**(a) Expected peak saving per rank, xl ({s.num_params:,} parameters), {world_size} ranks, AdamW.** "
            f"DDP keeps {fsdp_accounting.STATE_BYTES_PER_PARAM} B per parameter (fp32 weight, gradient, two "
            f"moments) on every rank; FSDP keeps 1/{world_size} of the {s.sharded_params:,} Linear/Embedding "
            "parameters (the norm gains stay whole) plus a working set of gathered weights and full gradients "
            f"(largest unit {s.largest_unit:,} parameters: the running unit and the prefetched ones, in the "
            "gather dtype; in backward also its gradient and two fp32 ones being reduced). Activations cancel.",
            "",
            "| gather dtype | DDP state | FSDP state | FSDP working set | saving | of DDP's state |",
            "| --- | --- | --- | --- | --- | --- |",
            *rows,
        ]
    )


D24_VARIANTS = (("fsdp_blocks", "per-block units (headline)"), ("fsdp", "per-Linear units (the handout's)"))


def _d24b_parts(v: dict, ddp: Record | None, timing_caveat: str | None = None) -> list[str]:
    parts = []
    if v.get("allgather_ready_share") is not None:
        share = v["allgather_ready_share"]
        verdict = (
            "**each all-gather finishes before its forward needs it**"
            if share >= 1.0
            else f"**{1 - share:.0%} of the unit forwards wait on their all-gather**"
        )
        parts.append(
            f"all-gather done before the unit's forward in {share:.0%} of the unit forwards: {verdict}"
        )
    if "allgather_hidden_mean" in v and "allgather_hidden_min" in v:
        parts.append(
            f"all-gather kernels {v['allgather_hidden_mean']:.0%} under compute on average, the least hidden "
            f"{v['allgather_hidden_min']:.0%}"
        )
    elif v.get("allgather_ready_share") is None:
        parts.append("no all-gather overlap measured (the profiled step runs on GPUs only)")
    if "state_vs_ddp" in v:
        parts.append(f"model state {v['state_vs_ddp']:.2f}× DDP's")
    if ddp is not None and "peak_memory_mib" in v and "peak_memory_mib" in ddp.values:
        saved = ddp.values["peak_memory_mib"] - v["peak_memory_mib"]
        parts.append(f"peak {format_number('mib', saved)} MiB below DDP's")
    if "time_vs_fsdp2" in v and timing_caveat:  # a ratio of load, not of the code: say so instead
        parts.append(f"step time vs torch's fully_shard: {timing_caveat}")
    elif "time_vs_fsdp2" in v:
        parts.append(f"step time {v['time_vs_fsdp2']:.2f}× torch's fully_shard at the same units")
    return parts


def d24b(records: list[Record]) -> str:
    rows = [r for r in rows_of(records, "fsdp") if not r.oom and not r.skipped]
    lines = []
    for (device, size, ctx, dtype, world), group in sorted(
        _settings(rows, "size", "ctx", "dtype", "world_size").items(), key=str
    ):
        by_variant = {str(r.descriptors.get("variant")): r for r in group}
        for variant, label in D24_VARIANTS:
            ours = by_variant.get(variant)
            if ours is None:
                continue
            parts = _d24b_parts(ours.values, by_variant.get("individual"), derived_from(*group))
            lines.append(
                f"On {device} ({size}, ctx {ctx}, {dtype}, {world} ranks), {label}: " + "; ".join(parts) + "."
            )
    if not lines:
        return f"**(b)** No measured FSDP rows in the given JSON; {D24_COMMAND} produces them."
    return "\n\n".join(["**(b)** Measured (our FSDP's rows of each setting):", *lines])


def d24_answer(records: list[Record]) -> str:
    return "\n\n".join([render_d24a(), d24b(records)])
