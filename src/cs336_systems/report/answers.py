"""Handout answers that combine measured rows with the closed forms of :mod:`cs336_systems.accounting`,
and the Markdown prose of the closed-form answers (accounting returns numbers only)."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from cs336_systems import accounting
from cs336_systems.accounting import (
    D6_SEQ_LENS,
    GB,
    H100_BYTES,
    XXL,
    GiB,
    MiB,
    ModelMemory,
    attention_memory,
    ddp_overhead_s,
    first_oom_seq,
    fsdp_tp_compute_bound,
    greedy_shards,
    largest_forward_tensors,
    minimal_ddp_overhead_s,
    model_memory,
    optimal_bucket_bytes,
    optimal_bucket_count,
    parameter_numels,
    residual_stream_bytes,
    sharding_communication,
    smallest_oom_case,
)
from cs336_systems.accounting import checkpointing as ckpt
from cs336_systems.accounting import fsdp as fsdp_accounting
from cs336_systems.model import BATCH_SIZE, PRESETS, ModelConfig
from cs336_systems.report.load import Record, numeric, rows_of
from cs336_systems.report.plots import _message_bytes
from cs336_systems.report.tables import format_number


def device_capacity_bytes(device: str) -> int:
    """HBM of the card a device name denotes ("NVIDIA H100 80GB HBM3" says it; an H200 has 141 GB);
    80 GiB when the name does not tell."""
    m = re.search(r"(\d+)\s*GB", device)
    if m:
        return int(m.group(1)) * 2**30
    if "H200" in device:
        return 141 * 10**9
    return accounting.H100_BYTES


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
    rows = rows_of(records, "attention")
    devices = sorted({r.device for r in rows})
    capacity = device_capacity_bytes(devices[0]) if devices else accounting.H100_BYTES
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


def d20_check(records: list[Record]) -> str:
    """Measured peaks of the D20 rows next to the model-state accounting of their preset: after init
    the parameters, before the step parameters + gradients + optimizer state (sharded unless the
    variant is "unsharded"); what is left over is buffers the accounting leaves out (e.g. DDP buckets)."""
    lines = []
    for r in rows_of(records, "sharding"):
        size, world = r.descriptors.get("size"), numeric(r.descriptors.get("world_size"))
        if r.oom or r.skipped or size not in PRESETS or world is None:
            continue
        if not {"peak_after_init_mib", "peak_before_step_mib"} <= set(r.values):
            continue
        variant = str(r.descriptors.get("variant", ""))
        mem = accounting.model_memory(PRESETS[size], int(world), sharded=variant != "unsharded")
        cells = [
            (r.values["peak_after_init_mib"], mem.params / accounting.MiB),
            (r.values["peak_before_step_mib"], mem.total / accounting.MiB),
        ]
        if "peak_after_step_mib" in r.values:
            cells.append((r.values["peak_after_step_mib"], mem.total / accounting.MiB))
        text = " | ".join(f"{format_number('mib', m)} / {format_number('mib', p)}" for m, p in cells)
        lines.append(f"| {variant} | {size} | {int(world)} | {text} |")
    if not lines:
        return ""
    return "\n".join(
        [
            "Measured / accounted peak memory per rank (MiB); accounted = parameters after init, parameters "
            "+ gradients + AdamW state (1/N of it when sharded) before and after the step:",
            "",
            "| variant | size | ranks | after init | before step | after step |",
            "| --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def allreduce_fit(records: list[Record]) -> tuple[float, float, str] | None:
    """(o, w, description) from the D13 rows of nccl at 2 ranks (else the backend/world size with most
    sizes): a least-squares fit of t = o + n/w."""
    by_setting: dict[tuple[str, str, str], list[tuple[float, float]]] = {}
    for r in rows_of(records, "allreduce"):
        size = _message_bytes(r)
        key = "mean_ms" if "mean_ms" in r.values else None
        if r.oom or r.skipped or size is None or key is None:
            continue
        setting = (
            str(r.descriptors.get("backend", "?")),
            str(r.descriptors.get("world_size", "?")),
            r.device,
        )
        by_setting.setdefault(setting, []).append((size, r.values[key] * 1e-3))
    usable = {k: v for k, v in by_setting.items() if len({p[0] for p in v}) >= 2}
    if not usable:
        return None
    preferred = [k for k in usable if k[0] == "nccl" and k[1] == "2"]
    setting = preferred[0] if preferred else max(usable, key=lambda k: len(usable[k]))
    sizes, times = zip(*usable[setting], strict=True)
    try:
        o, w = accounting.fit_allreduce_cost(sizes, times)
    except ValueError:
        return None
    if o <= 0:  # the sizes do not resolve a per-call cost: no optimum to compute from these rows
        return None
    return o, w, f"fit of the D13 {setting[0]} all-reduce at {setting[1]} ranks on {setting[2]}"


def spec_allreduce_fit() -> tuple[float, float, str]:
    """SPEC's reference NCCL figures on 2 × H200: 1 MiB in 0.034 ms, 1 GiB in 3.26 ms."""
    o, w = accounting.fit_allreduce_cost([2**20, 2**30], [0.034e-3, 3.26e-3])
    return o, w, "SPEC's NCCL reference at 2 × H200 (1 MiB 0.034 ms, 1 GiB 3.26 ms)"


def flash_speedups(records: list[Record]) -> str:
    """For each dtype and d: ours (an impl named *triton*) vs plain PyTorch at the longest seq both ran."""
    rows = [r for r in rows_of(records, "flash_sweep") if not r.oom and not r.skipped]
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
    for (dtype, d, _device), kinds in sorted(table.items()):
        common = set(kinds.get("ours", {})) & set(kinds.get("pytorch", {}))
        if not common:
            continue
        seq = max(common)
        ours, base = kinds["ours"][seq], kinds["pytorch"][seq]
        lines.append(f"| {dtype} | {d} | {int(seq)} | {ours:.3g} | {base:.3g} | {base / ours:.1f}× |")
    if not lines:
        return ""
    return "\n".join(
        [
            "Ours vs plain PyTorch at the longest sequence both ran (fwd+bwd where the sweep has passes):",
            "",
            "| dtype | d | seq | ours (ms) | PyTorch (ms) | speed-up |",
            "| --- | --- | --- | --- | --- | --- |",
            *lines,
        ]
    )


def d17_answer(records: list[Record]) -> str:
    """D17 (b): the bucketed-DDP overhead model with w and o fitted to this run's D13 rows (else SPEC's)."""
    fit = allreduce_fit(records)
    o, w, source = fit or spec_allreduce_fit()
    if fit is None and rows_of(records, "allreduce"):
        source += ", as the D13 rows here do not resolve a per-call cost"
    s = model_memory(PRESETS["xl"]).grads  # fp32 gradients of xl
    return render_d17(s, w, o, f"xl fp32 gradients; w and o from the {source}")


def d20_answer(records: list[Record]) -> str:
    return "\n\n".join(p for p in (d20_check(records), render_d20()) if p)


# ---------------------------------------------------------------- the closed-form answers, as prose


def _mib(n: float) -> str:
    return f"{n / MiB:,.1f} MiB"


def _gb(n: float) -> str:
    return f"{n / GB:,.2f} GB"


def render_d5(config: ModelConfig | None = None, contexts: Sequence[int] = (128, 256, 512)) -> str:
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


def render_d17(s: float, w: float, o: float, source: str) -> str:
    n_star = optimal_bucket_count(s, w, o)
    b_star = optimal_bucket_bytes(s, w, o)
    rows = "\n".join(
        f"| {mb:g} | {max(1, math.ceil(s / (mb * MiB)))} | "
        f"{ddp_overhead_s(s, w, o, max(1, math.ceil(s / (mb * MiB)))) * 1e3:.2f} |"
        for mb in (1, 10, 100, 1000)
    )
    return "\n".join(
        [
            "**(b) Overhead model.** With s model bytes, w all-reduce algorithm bandwidth, o seconds per "
            "call and n_b equal buckets, bucket i is ready at i·s/(n_b·w) (computing a bucket takes as long "
            "as moving it) and the all-reduces run back to back, each s/(n_b·w) + o, so the last ends "
            "s/(n_b·w) + n_b·o after backward:",
            "",
            "    overhead(n_b) = s / (n_b · w) + n_b · o",
            "    n_b* = sqrt(s / (w · o)),   b* = s / n_b* = sqrt(s · w · o),   overhead* = 2 · sqrt(s · o / w)",
            "",
            f"Numbers ({source}): s = {_gb(s)}, w = {w / GB:.1f} GB/s, o = {o * 1e6:.1f} µs ⇒ "
            f"n_b* = {n_star:.1f} buckets, b* = {b_star / MiB:,.0f} MiB, "
            f"overhead* = {minimal_ddp_overhead_s(s, w, o) * 1e3:.2f} ms (vs s/w + o = "
            f"{ddp_overhead_s(s, w, o, 1) * 1e3:.2f} ms with one bucket after backward).",
            "",
            "| bucket size (MiB) | buckets | modelled overhead (ms) |",
            "| --- | --- | --- |",
            rows,
        ]
    )


def render_d18(model: XXL | None = None) -> str:
    m = model or XXL()
    cb = fsdp_tp_compute_bound(d_ff=m.d_ff)
    tokens_examples = (0, 1024, 4096, 8192)
    fsdp_rows = "\n".join(
        f"| {t:,} | {_gb(m.activations(t))} | {m.min_fsdp(tokens=t)} | "
        f"{m.fsdp_bytes_per_device(m.min_fsdp(tokens=t), t) / GB:.3f} GB |"
        for t in tokens_examples
    )
    return "\n".join(
        [
            f"Assumptions: P = 2·d_model·d_ff·blocks = 2·{m.d_model}·{m.d_ff}·{m.num_blocks} = {m.params:,} "
            "parameters; fp32 master weights (4 B), fp32 accumulated gradients (4 B) and AdamW's two fp32 "
            "moments (8 B) = 16 B per parameter; bf16 activations; saved for backward are the inputs of "
            "both linears of every block (no activation function, no checkpointing); 80 GB = 80·10⁹ B, "
            "95 GB = 95·10⁹ B.",
            "",
            f"**(a)** Weights + gradients + optimizer state = 16·P = {m.state_bytes:,} B ≈ "
            f"{m.state_bytes / 1e12:.2f} TB ({m.state_bytes / GiB:,.0f} GiB), which is "
            f"{m.state_bytes / (80 * GB):.2f} → **{m.devices_to_hold()} H100 80GB** worth of memory "
            f"({m.state_bytes / H100_BYTES:.2f} cards of 80 GiB). Saved for backward: "
            f"(d_model + d_ff)·blocks·2 B = {m.activation_bytes_per_token:,} B ≈ "
            f"{m.activation_bytes_per_token / 1e6:.1f} MB per token (e.g. {_gb(m.activations(1024))} per 1,024 "
            f"tokens, {m.activations(1024) / (80 * GB):.2f} more H100s).",
            "",
            "**(b)** With state and half the activations sharded over N_FSDP devices and the other half "
            "replicated: memory per device = (16·P + A/2)/N_FSDP + A/2, A = activation bytes of the batch. "
            f"Ignoring activations, 16·P/N < 95 GB needs N_FSDP > {m.state_bytes / (95 * GB):.2f}, so "
            f"**N_FSDP = {m.min_fsdp()}**; the activations raise it:",
            "",
            "| tokens per batch | activations A | smallest N_FSDP | memory per device |",
            "| --- | --- | --- | --- |",
            fsdp_rows,
            "",
            "**(c)** Forward pass, X = 16 (FSDP, M_X = 2), Y = 4 (TP, M_Y = 1), C = 4.6·10¹⁴ FLOP/s, "
            f"W_ici = 2·9·10¹⁰ B/s, α = C/W_ici = {cb.alpha:,.1f}. Per layer T_math = 4·B·D·F/(N·C), "
            "T_FSDP = 4·D·F/(Y·W·M_X), T_TP = 4·B·D/(X·W·M_Y); compute bound while T_FSDP + T_TP ≤ T_math, "
            f"i.e. B ≥ (X·α/M_X)/(1 − Y·α/(F·M_Y)) = {16 * cb.alpha / 2:,.0f}/(1 − {4 * cb.alpha / m.d_ff:.4f}) "
            f"= {cb.batch_tokens:,.0f} tokens. **Per device: B/64 ≥ {cb.per_device_tokens:.1f} → "
            f"{cb.per_device_tokens_int} tokens; overall batch {cb.batch_tokens_int:,} tokens** "
            f"(X·α/M_X = {16 * cb.alpha / 2:,.0f} tokens if each communication only had to fit alone).",
            "",
            "**(d)** To keep the chips compute bound at a smaller batch, cut the bytes each FLOP needs or "
            "hide them: (1) the FSDP term does not depend on B, so the floor is B/N ≥ α/(M_X·Y)/(1−…): "
            "more tensor parallelism (larger Y, up to F/Y ≳ α/M_Y) or more mesh axes for FSDP (larger M_X) "
            "lowers it, and the Scaling Book's optimal X/Y split reaches B/N ≈ 2α²/F (~245 tokens here); "
            "(2) pipeline parallelism over a further axis: only activations of the stage boundaries move "
            "(2·B·D bytes per boundary), weights stay local, and micro-batches with an interleaved or "
            "zero-bubble schedule keep the bubble small (Narayanan et al. 2021; DeepSeek-V3's DualPipe); "
            "(3) communicate fewer bytes: all-gather weights in fp8 instead of bf16 halves T_FSDP and so "
            "the batch floor (DeepSeek-V3 uses fp8 communication); (4) prefetch the next layer's weights "
            "while computing the current one so FSDP traffic overlaps fully (what the sum condition "
            "assumes); (5) for MoE models, expert parallelism moves tokens rather than weights. Gradient "
            "accumulation does not help: it raises the batch instead of lowering it.",
        ]
    )


def render_d20(config: ModelConfig | None = None, world_size: int = 2) -> str:
    config = config or PRESETS["xl"]
    n = sum(parameter_numels(config))
    full = model_memory(config)
    ours = model_memory(config, world_size, sharded=True)
    comm = sharding_communication(n, world_size)

    def row(name: str, mem: ModelMemory) -> str:
        return f"| {name} | {_mib(mem.params)} | {_mib(mem.grads)} | {_mib(mem.optim_state)} | {_mib(mem.total)} |"

    return "\n".join(
        [
            f"**Expected memory per rank, {config.name} (Φ = {n:,} parameters), fp32 with AdamW, "
            f"{world_size} ranks.** Peak after init = parameters; right before the step (steady state) = "
            "parameters + gradients + optimizer state; activations are freed by then.",
            "",
            "| setting | parameters (= after init) | gradients | optimizer state | total (= before step) |",
            "| --- | --- | --- | --- | --- |",
            row("unsharded (DDP)", full),
            row(f"sharded over {world_size} (ours, ZeRO-1)", ours),
            "",
            f"**(c) Ours vs ZeRO stage 1.** Memory: both keep full fp32 parameters and gradients on every "
            f"rank and 1/N of the AdamW state (4Φ + 4Φ + 8Φ/N bytes; {_mib(ours.total)} vs {_mib(full.total)} "
            "unsharded). ZeRO-1 splits one flat buffer evenly, we assign whole tensors (slightly uneven "
            f"shards: largest {max(greedy_shards(parameter_numels(config), world_size)):,} of {n:,} elements); "
            "with mixed precision ZeRO-1 also shards the fp32 master copy (K = 12 bytes/param of state), which "
            "we do not have. Communication per rank and step (ring algorithms, Φ bytes of fp32): plain "
            f"DDP all-reduces gradients, 2Φ(N−1)/N = {_gb(comm.ddp)}; ZeRO-1 reduce-scatters the "
            "gradients and all-gathers the updated parameters, Φ(N−1)/N each = "
            f"{_gb(comm.zero1)}, the same as DDP; ours all-reduces the full gradients and then broadcasts "
            f"each owner's parameters, 3Φ(N−1)/N = {_gb(comm.ours)}, 1.5× as much, and every rank "
            "receives averaged gradients for parameters it never updates.",
        ]
    )


# ---------------------------------------------------------------- 2026: checkpointing (D22), FSDP (D24)

D22_COMMAND = "`pytest bench/bench_memory.py -k checkpointing --benchmark-json=OUT.json` (1 GPU)"
D24_COMMAND = "`pytest bench/bench_fsdp.py --benchmark-json=OUT.json` (2 GPUs)"


def _policy(r: Record) -> str:
    return str(r.descriptors.get("policy", r.texts.get("checkpoint", "")))


def _step_ms(r: Record) -> float | None:
    return r.values.get("median_ms", r.values.get("mean_ms"))


def _every_k(policy: str) -> int | None:
    head, _, k = policy.partition(":")
    return int(k) if head == "every" and k.isdigit() else None


def _settings(rows: list[Record], *keys: str) -> dict[tuple, list[Record]]:
    """Rows grouped by device and the descriptors ``keys`` (one measured setting each)."""
    out: dict[tuple, list[Record]] = {}
    for r in rows:
        out.setdefault((r.device, *(r.descriptors.get(k) for k in keys)), []).append(r)
    return out


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
        if none is not None and "peak_memory_mib" in none.values and best_ms and _step_ms(none):
            text += (
                f"; without checkpointing {format_number('mib', none.values['peak_memory_mib'])} MiB. It costs "
                f"{best_ms / _step_ms(none):.2f}× the step time ({best_ms:.0f} vs {_step_ms(none):.0f} ms; the "
                f"accounting's one extra forward per block: {ckpt.single_level(n, k).compute_ratio():.2f}×)"
            )
        nested = by_policy.get("nested")
        if nested is not None and "peak_memory_mib" in nested.values and _step_ms(nested):
            text += (
                f"; nested: {format_number('mib', nested.values['peak_memory_mib'])} MiB at "
                f"{_step_ms(nested):.0f} ms"
            )
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
        return f"**(b)** No measured checkpointing rows in the given JSON; {D22_COMMAND} produces them."
    return "\n\n".join(["**(b)** Measured (peak memory per step, step time median):", *lines])


def d22_answer(records: list[Record]) -> str:
    return "\n\n".join([render_d22a(PRESETS["xl"].num_layers), d22b(records)])


def render_d24a(world_size: int = 2) -> str:
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


def _d24b_parts(v: dict, ddp: Record | None) -> list[str]:
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
    if "time_vs_fsdp2" in v:
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
            parts = _d24b_parts(ours.values, by_variant.get("individual"))
            lines.append(
                f"On {device} ({size}, ctx {ctx}, {dtype}, {world} ranks), {label}: " + "; ".join(parts) + "."
            )
    if not lines:
        return f"**(b)** No measured FSDP rows in the given JSON; {D24_COMMAND} produces them."
    return "\n\n".join(["**(b)** Measured (our FSDP's rows of each setting):", *lines])


def d24_answer(records: list[Record]) -> str:
    return "\n\n".join([render_d24a(), d24b(records)])
