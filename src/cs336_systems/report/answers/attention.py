"""Answers about one device's attention and memory (D5, D6/D7a, D11): the residual stream and largest
tensors, the attention memory accounting against the measured OOM and saved bytes, and the flash
sweep's speed-ups."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from cs336_systems.report.answers.common import H100_BYTES, GiB, MiB, _mib, device_capacity_bytes
from cs336_systems.report.load import Record, numeric, rows_of, unreliable
from cs336_systems.report.tables import format_number

if TYPE_CHECKING:
    from cs336_systems.model import ModelConfig


def smallest_measured_oom(records: list[Record]) -> tuple[int, int] | None:
    """(seq, d) of the smallest D6/D7a case of the eager implementation that ran out of memory."""
    cases = []
    for r in rows_of(records, "attention"):
        impl = str(r.descriptors.get("impl", "pytorch"))
        seq, d = numeric(r.descriptors.get("seq")), numeric(r.descriptors.get("d"))
        if r.oom and impl == "pytorch" and seq is not None and d is not None:
            cases.append((int(seq), int(d)))
    return min(cases) if cases else None


def d6_memory_check(records: list[Record]) -> str:
    """Measured memory vs the accounting, per D6/D7a row: how many (batch, seq, seq) fp32 matrices the
    implementation really keeps for backward. Uses ``saved_for_bwd_mib`` (allocated after the forward
    minus before it: the output O plus what autograd saved) where the bench records it, else
    ``mem_before_bwd_mib`` (which also holds q, k, v and the incoming gradient dO)."""
    from cs336_systems import accounting  # torch: imported when a closed form is asked for

    lines = []
    for r in rows_of(records, "attention"):
        seq, d = numeric(r.descriptors.get("seq")), numeric(r.descriptors.get("d"))
        if r.oom or r.skipped or seq is None or d is None:
            continue
        batch = int(numeric(r.descriptors.get("batch")) or accounting.D6_BATCH)
        m = accounting.attention_memory(int(seq), int(d), batch)
        if "saved_for_bwd_mib" in r.values:
            what, measured, vectors = "saved", r.values["saved_for_bwd_mib"] * accounting.MiB, 1  # O
        elif "mem_before_bwd_mib" in r.values:
            what, measured, vectors = "in use", r.values["mem_before_bwd_mib"] * accounting.MiB, 5
        else:
            continue
        predicted = m.score_matrix + vectors * m.vector_tensor
        matrices = (measured - vectors * m.vector_tensor) / m.score_matrix
        lines.append(
            f"| {r.descriptors.get('impl', '?')} | {int(d)} | {int(seq)} | {what} | "
            f"{format_number('mib', measured / accounting.MiB)} | "
            f"{format_number('mib', predicted / accounting.MiB)} | {matrices:.2f} |"
        )
    if not lines:
        return ""
    return "\n".join(
        [
            "Measured vs predicted memory at the start of backward. Predicted: one (batch, seq, seq) fp32 "
            'matrix P plus the (batch, seq, d) tensors counted: O for "saved" (allocated by the forward), '
            'q, k, v, O and dO for "in use". The last column is (measured − those tensors) / one score '
            "matrix: how many score-sized matrices the implementation keeps for backward (1 = just P).",
            "",
            "| impl | d | seq | measured | measured (MiB) | predicted (MiB) | score matrices kept |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def d6_answer(records: list[Record]) -> str:
    """The accounting for the smallest OOM case of the run (or the predicted one), on the run's card,
    with a note when the run ran out where the accounting says it should fit."""
    from cs336_systems import accounting  # torch: imported when a closed form is asked for

    rows = rows_of(records, "attention")
    devices = sorted({r.device for r in rows})
    capacity = device_capacity_bytes(devices[0]) if devices else H100_BYTES
    measured = smallest_measured_oom(records)
    causal = any(r.descriptors.get("causal") is True for r in rows)
    parts = [render_d6(capacity, measured_oom=measured, causal=causal)]
    if measured is not None:
        peak = accounting.attention_memory(*measured, causal=causal).peak
        if peak < capacity:
            parts.append(
                f"The run ran out at seq {measured[0]}, d {measured[1]}, although the accounting's peak "
                f"({peak / accounting.MiB:,.0f} MiB) fits the {capacity / accounting.GiB:,.0f} GiB card: the "
                "benchmark keeps more alive than the minimal accounting (see the last column of the table below)."
            )
    parts.append(d6_memory_check(records))
    return "\n\n".join(p for p in parts if p)


def flash_speedups(records: list[Record]) -> str:
    """For each dtype and d: ours (an impl named *triton*) vs plain PyTorch at the longest seq both ran."""
    rows = [r for r in rows_of(records, "flash_sweep") if not r.oom and not r.skipped]
    # no speed-up from a timing that is not a result (interpreter, contention): the table marks those rows
    left_out = sum(1 for r in rows if unreliable(r))
    rows = [r for r in rows if not unreliable(r)]
    pass_key = next((k for k in ("pass_", "mode") if any(k in r.descriptors for r in rows)), None)
    if pass_key:
        rows = [r for r in rows if r.descriptors.get(pass_key) in ("fwd_bwd", None)]
    key = "do_bench_ms" if any("do_bench_ms" in r.values for r in rows) else "mean_ms"
    table: dict[tuple[str, str, str], dict[str, dict[float, float]]] = {}
    for r in rows:
        impl = str(r.descriptors.get("impl", ""))
        kind = "ours" if "triton" in impl else "pytorch" if impl == "pytorch" else None
        seq = numeric(r.descriptors.get("seq"))
        if kind is None or seq is None or key not in r.values:
            continue
        setting = (str(r.descriptors.get("dtype", "?")), str(r.descriptors.get("d", "?")), r.device)
        table.setdefault(setting, {}).setdefault(kind, {})[seq] = r.values[key]
    lines = []
    absent = _not_plotted(records)
    for (dtype, d, _device), kinds in sorted(table.items()):
        common = set(kinds.get("ours", {})) & set(kinds.get("pytorch", {}))
        if not common:
            continue
        seq = max(common)
        ours, base = kinds["ours"][seq], kinds["pytorch"][seq]
        lines.append(f"| {dtype} | {d} | {int(seq)} | {ours:.3g} | {base:.3g} | {base / ours:.1f}× |")
    caveat = (
        f"{left_out} row(s) whose timing is not a result (see the table's footnotes) are left out of the speed-ups."
        if left_out
        else ""
    )
    if not lines:
        return "\n\n".join(p for p in (absent, caveat) if p)
    return "\n".join(
        [
            *([absent, ""] if absent else []),
            *([caveat, ""] if caveat else []),
            "Ours vs plain PyTorch at the longest sequence both ran (fwd+bwd where the sweep has passes):",
            "",
            "| dtype | d | seq | ours (ms) | PyTorch (ms) | speed-up |",
            "| --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def render_d5(config: ModelConfig | None = None, contexts: Sequence[int] = (128, 256, 512)) -> str:
    from cs336_systems.accounting import largest_forward_tensors, residual_stream_bytes
    from cs336_systems.model import BATCH_SIZE, PRESETS

    config = config or PRESETS["2.7B"]
    rows = [
        f"| {t} | {BATCH_SIZE}·{t}·{config.d_model}·4 = {residual_stream_bytes(config, t):,} B | "
        f"{residual_stream_bytes(config, t) / MiB:g} MiB |"
        for t in contexts
    ]
    big = largest_forward_tensors(config, max(contexts))
    big_rows = [f"| {name} | {_mib(n)} |" for name, n in big.items()]
    return "\n".join(
        [
            f"**(d) Residual-stream activation of the {config.name} model (fp32).** A residual-stream tensor "
            f"has shape (batch, ctx, d_model) = ({BATCH_SIZE}, ctx, {config.d_model}); in single precision "
            "it takes batch·ctx·d_model·4 bytes:",
            "",
            "| ctx | bytes | size |",
            "| --- | --- | --- |",
            *rows,
            "",
            f"**(e) Largest single tensors of a forward pass** at ctx {max(contexts)} (batch {BATCH_SIZE}, "
            "fp32), which are the allocations memory_viz keeps at a low Detail level:",
            "",
            "| tensor | size |",
            "| --- | --- |",
            *big_rows,
        ]
    )


def render_d6(
    capacity_bytes: int = H100_BYTES, measured_oom: tuple[int, int] | None = None, causal: bool = False
) -> str:
    """Markdown: the accounting of the smallest OOM case (measured if given as (seq, d), else
    predicted), how the saved memory grows with seq, and the way out."""
    from cs336_systems.accounting import D6_SEQ_LENS, attention_memory, first_oom_seq, smallest_oom_case

    predicted = smallest_oom_case(capacity_bytes, causal=causal)
    if measured_oom is not None:
        case, origin = (
            attention_memory(*measured_oom, causal=causal),
            "the smallest case that ran out in the run",
        )
    elif predicted is not None:
        case, origin = predicted, "the smallest grid case predicted to run out"
    else:
        case = first_oom_seq(capacity_bytes, causal=causal)
        origin = (
            f"no grid case is predicted to run out on the {capacity_bytes / GiB:g} GiB card; the first that "
            "would is one doubling past the grid"
        )
    b, t, d = case.batch, case.seq, case.d
    growth = "\n".join(
        f"| {s} | {_mib(attention_memory(s, 16, b).score_matrix)} | "
        f"{_mib(attention_memory(s, 16, b).saved_for_backward)} | {_mib(attention_memory(s, 16, b).peak)} |"
        for s in D6_SEQ_LENS
    )
    return "\n".join(
        [
            f"**Memory accounting (batch {b}, seq {t}, d {d}, fp32): {origin}.** One score matrix is "
            f"batch·seq²·4 = {b}·{t}²·4 B = {_mib(case.score_matrix)}; a (batch, seq, d) tensor is "
            f"{_mib(case.vector_tensor)}.",
            "",
            f"- saved for backward: P + q, k, v = {_mib(case.saved_for_backward)} "
            f"(with the output O, {_mib(case.before_backward)} in use when backward starts);",
            f"- forward peak: S and P (or S and S/√d) alive together = {_mib(case.forward_peak)};",
            f"- backward peak: P, dP and dS alive together in softmax backward = {_mib(case.backward_peak)} "
            f"vs {capacity_bytes / GiB:g} GiB on the card.",
            "",
            "Saved-for-backward memory grows quadratically with seq (×4 per doubling), and barely with d:",
            "",
            "| seq | one score matrix | saved for backward (d 16) | predicted peak (d 16) |",
            "| --- | --- | --- | --- |",
            growth,
            "",
            "To remove the seq² cost, never materialize P: compute attention tile by tile with an online "
            "softmax and keep only the row logsumexp L (batch·seq floats) for backward, recomputing P "
            "tile by tile there (FlashAttention-2, D9–D10); memory becomes O(batch·seq·d).",
        ]
    )


def _not_plotted(records: list[Record]) -> str:
    """The sweep's implementations with no timed row (so absent from the D11 plot), and why."""
    rows = rows_of(records, "flash_sweep")
    timed = {str(r.descriptors.get("impl")) for r in rows if not r.oom and not r.skipped}
    why: dict[str, str] = {}
    for r in rows:
        impl = str(r.descriptors.get("impl"))
        if impl not in timed:
            # the reason itself is the D11 table's footnote: named here, not repeated
            status = (
                "out of memory" if r.oom else r.texts.get("status", "skipped" if r.skipped else "not run")
            )
            why.setdefault(impl, f"{status} (the table's footnotes say why)")
    if rows and not any("triton" in str(r.descriptors.get("impl")) for r in rows):
        why["flash_triton"] = (
            "no row in this sweep: the bench times it on a GPU only (on a CPU the Triton interpreter "
            "would be timed, not the kernel)"
        )
    if not why:
        return ""
    listed = "; ".join(f"`{impl}`: {reason}" for impl, reason in sorted(why.items()))
    return f"Not in the plot, as none of their rows ran here: {listed}."
