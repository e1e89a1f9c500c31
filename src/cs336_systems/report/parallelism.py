"""The writeup section of the 2026 parallelism answers (D25): rendering only.

Every number comes from :mod:`cs336_systems.accounting.parallelism`; this module picks the hardware
figures (C from the measured matmul rate, W from the all-reduce bench's busbw, else stated defaults),
formats the answers as Markdown and draws the largest-device-count-vs-batch plot.

    python -m cs336_systems.report.parallelism [results.json ...] [--out DIR]

writes ``DIR/parallelism.md`` and ``DIR/plots/d25_max_devices.png``. In the writeup, register it with
:func:`register` (see there).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cs336_systems.accounting import parallelism as P
from cs336_systems.report.load import unreliable
from cs336_systems.rows.contention import row_verdict

SECTION_KEY = "D25"
TITLE = "2026: parallelism accounting (alternate_ring_all_reduce, data_parallel_calcs, fsdp_calcs, tp_calcs, fsdp_tp_calcs; D25)"
PLOT_NAME = "d25_max_devices.png"

# The stated constants, both of one machine (an H200), used together when no machine measured both.
DEFAULT_C = 790e12
DEFAULT_W = 330e9
DEFAULT_C_SOURCE = (
    "stated constant: the bf16 dense matmul rate measured on an H200 (docs/perf-notes.md, D26: "
    "775–790 TFLOP/s on each GPU)"
)
DEFAULT_W_SOURCE = (
    "stated constant: the NCCL all-reduce busbw of 2 × H200 over NVLink at 1 GiB (SPEC.md, reference figures)"
)
# The FFN of the D26 8B configuration (SPEC): d_model 4096, d_ff 11,008.
D_MODEL, D_FF = 4096, 11008
EXAMPLE_B = 2**20  # global batch, tokens
EXAMPLE_N = 8  # devices, for the per-device numbers
EXAMPLE_2D = (16, 4)  # N_FSDP × N_TP for the 2D numbers
EXAMPLE_SPLIT_N = 1024
PLOT_BATCHES = [2**k for k in range(10, 25)]
STRATEGIES = ("DP", "FSDP", "TP", "2D overlapped", "2D shared")


# ------------------------------------------------------------------------------------ hardware figures


@dataclass(frozen=True)
class Measured:
    """One hardware figure measured by a row whose timing is a result, and the device that measured it."""

    value: float
    source: str
    device: str


@dataclass(frozen=True)
class Hardware:
    c: float  # FLOP/s
    w: float  # bytes/s egress per device
    c_source: str
    w_source: str

    @property
    def alpha(self) -> float:
        return P.alpha(self.c, self.w)


def measured_pair(c: Measured, w: Measured) -> Hardware:
    """C and W of one machine; figures of two machines never meet in one answer (an H200's C beside a
    loaded CPU's gloo W made "largest N_DP = 1"): a ValueError names both."""
    if c.device != w.device:
        raise ValueError(
            f"C measured on {c.device or 'an unnamed device'} and W on {w.device or 'an unnamed device'}: "
            "figures of different machines do not make one answer"
        )
    return Hardware(c.value, w.value, c.source, w.source)


def _fields(record: Any) -> tuple[str, str | None, str, dict[str, Any]]:
    """(group, group key, device, params + extra_info) of a report Record or a raw pytest-benchmark row."""
    if isinstance(record, dict):
        extra = dict(record.get("extra_info") or {})
        merged = {**(record.get("params") or {}), **extra}
        return (
            str(record.get("group") or ""),
            extra.get("group_key"),
            str(extra.get("device_name", "")),
            merged,
        )
    merged = {**record.descriptors, **record.values, **getattr(record, "texts", {})}
    return record.group, getattr(record, "group_key", None), record.device, merged


def _number(value: Any) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if out > 0 else None


def _verdict(record: Any) -> str | None:
    """The row's one verdict (the tables'): a report Record through ``load.unreliable``, a raw
    pytest-benchmark row through ``contention.row_verdict`` (the same judgement)."""
    if isinstance(record, dict):
        return row_verdict(record.get("extra_info") or {}, record.get("params"))
    return unreliable(record)


def _results(records: Iterable[Any], figure: Callable[[Any], bool]) -> tuple[list[Any], int]:
    """The rows holding ``figure`` whose timing is a result, and how many holding it are not: C and W
    come from measured rows only where their tables print the figure (issue 57: α came out of a gloo
    all-reduce row its table marked unreliable)."""
    rows = [r for r in records if figure(r)]
    kept = [r for r in rows if _verdict(r) is None]
    return kept, len(rows) - len(kept)


def _is_matmul_row(record: Any) -> bool:
    _group, _key, _device, f = _fields(record)
    return _number(f.get("matmul_tflops")) is not None and str(f.get("dtype", "bf16")) in (
        "bf16",
        "fp16",
        "bfloat16",
        "float16",
    )


def _is_allreduce_row(record: Any) -> bool:
    group, key, _device, f = _fields(record)
    return _number(f.get("busbw_gbps")) is not None and (key == "allreduce" or group.startswith("D13"))


def measured_c(records: Iterable[Any]) -> dict[str, Measured]:
    """Per device, the largest measured bf16/fp16 matmul rate (extra_info ``matmul_tflops`` of the model
    benches) among the rows whose timing is a result."""
    best: dict[str, Measured] = {}
    for record in _results(records, _is_matmul_row)[0]:
        group, _key, device, f = _fields(record)
        rate = _number(f.get("matmul_tflops")) * 1e12
        if device not in best or rate > best[device].value:
            where = f" on {device}" if device else ""
            source = f"measured {f.get('dtype', '')} matmul rate (`matmul_tflops` of {group}){where}"
            best[device] = Measured(rate, source, device)
    return best


def measured_w(records: Iterable[Any]) -> dict[str, Measured]:
    """Per device, the busbw of the D13 all-reduce at its largest size, preferring NCCL at 2 ranks,
    among the rows whose timing is a result."""
    ranked: dict[str, tuple[tuple, Measured]] = {}
    for record in _results(records, _is_allreduce_row)[0]:
        _group, _key, device, f = _fields(record)
        size_bytes = _number(f.get("bytes"))
        rank = (f.get("backend") == "nccl", str(f.get("world_size")) == "2", size_bytes or 0.0)
        size = f"{size_bytes / 2**20:,.0f} MiB" if size_bytes else "largest size"
        where = f" on {device}" if device else ""
        source = (
            f"busbw of the D13 all-reduce ({f.get('backend', '?')}, {f.get('world_size', '?')} ranks, {size})"
            f"{where}"
        )
        if device not in ranked or rank > ranked[device][0]:
            ranked[device] = (rank, Measured(_number(f.get("busbw_gbps")) * 1e9, source, device))
    return {device: m for device, (_rank, m) in ranked.items()}


def _why_default(records: list[Any], c: dict[str, Measured], w: dict[str, Measured]) -> str:
    """Why the stated constants stand: which figure no reliable row measured, or that C and W were
    measured on different machines."""
    if c and w:
        return (
            f"C was measured on {', '.join(sorted(c))} and W on {', '.join(sorted(w))}: figures of "
            "different machines do not make one answer"
        )
    missing = [
        (name, figure, rows) for name, found, figure, rows in (
            ("C", c, _is_matmul_row, "model rows"),
            ("W", w, _is_allreduce_row, "D13 rows"),
        ) if not found
    ]  # fmt: skip
    reasons = []
    for name, figure, rows in missing:
        left_out = _results(records, figure)[1]
        said = f"the {left_out} {rows} measuring it are not results (their table marks them)"
        reasons.append(f"no {name}: " + (said if left_out else f"no {rows}"))
    return "; ".join(reasons)


def _preference(device: str, c: Measured) -> tuple[bool, float]:
    return (not device.lower().startswith("cpu"), c.value)  # a GPU's figures answer a GPU question


def hardware(records: Iterable[Any]) -> Hardware:
    """C and W from one machine's rows whose timing is a result (a GPU's before a CPU's), else the
    stated constants for both, saying why."""
    records = list(records)
    c, w = measured_c(records), measured_w(records)
    both = [device for device in c if device in w]
    if both:
        device = max(both, key=lambda d: _preference(d, c[d]))
        return measured_pair(c[device], w[device])
    why = _why_default(records, c, w)
    return Hardware(DEFAULT_C, DEFAULT_W, f"{DEFAULT_C_SOURCE}; {why}", DEFAULT_W_SOURCE)


# -------------------------------------------------------------------------------------------- format


def _seconds(t: float) -> str:
    if t >= 1:
        return f"{t:.3g} s"
    if t >= 1e-3:
        return f"{t * 1e3:.3g} ms"
    return f"{t * 1e6:.3g} µs"


def _flops(x: float) -> str:
    return f"{x / 1e12:,.3g} TFLOP" if x >= 1e12 else f"{x / 1e9:,.3g} GFLOP"


def _row(what: str, formula: str, value: str) -> str:
    return f"| {what} | `{formula}` | {value} |"


def _table(rows: list[str]) -> list[str]:
    return ["| quantity | closed form | value |", "| --- | --- | --- |", *rows, ""]


def _strategy_rows(calcs: P.StrategyCalcs, network: P.Network = "shared") -> list[str]:
    f = calcs.formulas
    fwd, bwd = calcs.forward, calcs.backward
    comm_keys = [k for k in f if "communication" in k]

    def comm(cost: P.PassCost) -> str:
        total = _seconds(cost.comm_s(network))
        if not (cost.weight_bytes and cost.activation_bytes):
            return total
        parts = f"FSDP {_seconds(cost.weight_bytes / cost.w)}, TP {_seconds(cost.activation_bytes / cost.w)}"
        return f"{parts} → {total} ({network})"

    return [
        _row(
            "forward FLOPs / device", f["forward FLOPs"], f"{_flops(fwd.flops)} = {_seconds(fwd.compute_s)}"
        ),
        _row(
            "backward FLOPs / device", f["backward FLOPs"], f"{_flops(bwd.flops)} = {_seconds(bwd.compute_s)}"
        ),
        _row(comm_keys[0], f[comm_keys[0]], comm(fwd)),
        _row(comm_keys[1], f[comm_keys[1]], comm(bwd)),
    ]


def parallelism_answer(records: Sequence[Any] = ()) -> str:
    """The D25 answers as Markdown (no heading, no plot), for the hardware the records measured."""
    hw = hardware(records)
    c, w, b, d, ff, n = hw.c, hw.w, EXAMPLE_B, D_MODEL, D_FF, EXAMPLE_N
    s = 3 * d * ff * P.FP16
    ring, alt = P.ring_all_reduce(s, n, w), P.alternate_ring_all_reduce(s, n, w)
    dp, fsdp, tp = (fn(n, b, d, ff, c, w) for fn in (P.data_parallel_calcs, P.fsdp_calcs, P.tp_calcs))
    x, y = EXAMPLE_2D
    lines = [
        f"C = {c / 1e12:,.3g} TFLOP/s ({hw.c_source}); W = {w / 1e9:,.3g} GB/s ({hw.w_source}); "
        f"α = C/W = {hw.alpha:,.0f} FLOPs per byte. The ring's per-device egress rate is the bus bandwidth "
        "nccl-tests report, so W = busbw.",
        "",
        "Model (assumptions where the handout leaves a choice): N devices, every pair linked, each sends "
        "≤ W bytes/s; a ring step lasts (largest bytes a device sends)/W, no latency; fp16 values (2 B); "
        "FFN x1 = xW1, x2 = xW2, z = f(x1)⊙x2, y = zW3 with B the global batch in tokens; only matmuls "
        "count (forward 6·B·D·D_FF, backward 12·B·D·D_FF FLOPs); a pass is communication-bound when its "
        "communication time exceeds its compute time (perfect overlap), a step when either pass is. "
        f"Numbers below: the D26 8B FFN, D = {d:,}, D_FF = {ff:,}, B = {b:,} tokens, N = {n}. Each closed "
        "form is checked against a step-by-step simulation in `tests/test_parallelism.py`.",
        "",
        f"**Alternate ring all-reduce.** Each device passes its whole buffer around the ring, adding what "
        f"it receives: N−1 steps of S bytes. For S = 3·D·D_FF·2 B = {s / 1e6:,.1f} MB (the FFN's "
        "gradients):",
        "",
        *_table(
            [
                _row("alternate all-reduce", alt.formula, _seconds(alt.time_s)),
                _row("reduce-scatter + all-gather ring", ring.formula, _seconds(ring.time_s)),
                _row("ratio", "N/2", f"{alt.time_s / ring.time_s:.2f}"),
            ]
        ),
        "**Data parallel.** Backward all-reduces the 3·D·D_FF gradient values; it is hidden under the "
        "backward matmuls while N ≤ 1 + B·W/C:",
        "",
        *_table([*_strategy_rows(dp), _row("largest N_DP", dp.formulas["largest N"], f"{dp.max_devices:,}")]),
        "**FSDP.** Forward all-gathers the weights, backward gathers them again and reduce-scatters the "
        "gradients: 1.5× DP's traffic, and the same limit, since the forward pass carries a third of it "
        "against a third of the FLOPs:",
        "",
        *_table(
            [
                *_strategy_rows(fsdp),
                _row("largest N_FSDP", fsdp.formulas["largest N"], f"{fsdp.max_devices:,}"),
            ]
        ),
        "**Tensor parallel** (W1, W2 column-parallel, W3 row-parallel, device i of N; x and dy replicated). "
        "Backward:",
        "",
        *[f"- {eq}" for eq in tp.backward_equations],
        "",
        *_table(
            [
                *_strategy_rows(tp),
                _row(
                    "largest N_TP (forward binds)",
                    tp.formulas["largest N (forward binds)"],
                    f"{tp.max_devices:,}",
                ),
                _row(
                    "largest N_TP (backward alone)",
                    tp.formulas["largest N (backward alone)"],
                    f"{P.tp_max_devices(ff, c, w, 'backward'):,}",
                ),
            ]
        ),
        "It does not depend on B: both the FLOPs and the all-reduced activations scale with B.",
        "",
        f'**2D: FSDP × TP** (X = N_FSDP, Y = N_TP, N = X·Y; numbers for {x} × {y}). "Overlapped": the '
        "FSDP (X-axis) and TP (Y-axis) collectives run at once on separate links (communication time = "
        'the larger); "shared": they share each device\'s egress W (the sum). The forward pass binds.',
        "",
    ]
    for network in P.NETWORKS:
        mesh = P.fsdp_tp_calcs(x, y, b, d, ff, c, w, network)
        best = P.fsdp_tp_max_devices(b, ff, c, w, network)
        split = P.fsdp_tp_split_for(EXAMPLE_SPLIT_N, b, d, ff, c, w, network)
        key = f"largest N, {network}"
        lines += [
            f"_{network}_:",
            "",
            *_table(
                [
                    *_strategy_rows(mesh, network),
                    _row("communication time", mesh.formulas[f"{network}: time"], "per pass, above"),
                    _row(
                        key,
                        mesh.formulas[key],
                        f"{best.n:,} = {best.n_fsdp:,} × {best.n_tp:,} "
                        f"(continuous optimum X* = {best.x_continuous:,.1f}, Y* = {best.y_continuous:.2f})",
                    ),
                    _row(
                        f"best split of N = {EXAMPLE_SPLIT_N:,}",
                        mesh.formulas["optimal split at a given N, shared"]
                        if network == "shared"
                        else "3·D_FF·(X−1) = 2·B·(N/X − 1)",
                        f"{split.n_fsdp} × {split.n_tp} (X* = {split.x_continuous:.1f}); "
                        f"{'communication-bound' if P.fsdp_tp_calcs(split.n_fsdp, split.n_tp, b, d, ff, c, w, network).comm_bound() else 'compute-bound'}",
                    ),
                ]
            ),
        ]
    lines += [
        "2D multiplies the limits: FSDP's is set by the tokens per device (B/α), TP's by the width "
        "(1.5·D_FF/α), so the overlapped mesh reaches their product; on a shared network the two axes "
        "draw on one budget, (X−1)/B + 2(Y−1)/(3·D_FF) ≤ W/C, which the optimal split divides.",
    ]
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- plot


def max_devices_curves(hw: Hardware, batches: Sequence[int] = PLOT_BATCHES) -> dict[str, list[int]]:
    return {s: [P.max_devices(s, b, D_FF, hw.c, hw.w) for b in batches] for s in STRATEGIES}


def plot_max_devices(records: Sequence[Any], path: str | Path) -> Path:
    """Largest device count before communication-bound vs global batch, per strategy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hw = hardware(records)
    curves = max_devices_curves(hw)
    styles = {"DP": "-o", "FSDP": "--x", "TP": "-s", "2D overlapped": "-^", "2D shared": "-v"}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for name, values in curves.items():
        label = "FSDP (= DP)" if name == "FSDP" else name
        ax.plot(PLOT_BATCHES, values, styles[name], label=label, markersize=4)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("global batch B (tokens)")
    ax.set_ylabel("largest N before communication-bound")
    ax.set_title(
        f"D25: FFN D={D_MODEL}, D_FF={D_FF}; C={hw.c / 1e12:.3g} TFLOP/s, W={hw.w / 1e9:.3g} GB/s", fontsize=9
    )
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parallelism_section(records: Sequence[Any], out_dir: str | Path) -> str:
    """The whole section: heading, answers and the plot (written to ``out_dir/plots/``, linked
    relative to ``out_dir``, where writeup.md sits)."""
    out_dir = Path(out_dir)
    plot = plot_max_devices(records, out_dir / "plots" / PLOT_NAME)
    return "\n".join(
        [
            f"## {TITLE}",
            "",
            parallelism_answer(records),
            "",
            f"![{SECTION_KEY}]({plot.relative_to(out_dir).as_posix()})",
            "",
        ]
    )


# ------------------------------------------------------------------------------------- registration


def register(writeup: Any) -> None:
    """Hook this section into the writeup-section registry of ``cs336_systems.report.writeup``:

        from cs336_systems.report import parallelism, writeup
        parallelism.register(writeup)

    It registers a ``Section`` keyed D25 (always shown; answer from the records) and adds the plot
    to the writeup's ``PLOTS`` so it lands in ``DIR/plots/`` and is linked in the section.
    """
    writeup.register_section(
        writeup.Section(
            key=SECTION_KEY,
            title=TITLE,
            asks="Closed forms in S, N, W, B, D, D_FF, C for the alternate ring all-reduce, DP, FSDP, TP "
            "and 2D FSDP+TP, and the largest device count before communication-bound.",
            bench="closed form (accounting/parallelism.py), checked by accounting/simulator.py",
            answer=parallelism_answer,
            always=True,
        )
    )
    entry = (SECTION_KEY, PLOT_NAME, plot_max_devices)
    if all(p[0] != SECTION_KEY for p in writeup.PLOTS):
        writeup.PLOTS = (*writeup.PLOTS, entry)


# --------------------------------------------------------------------------------------- standalone


def _load_rows(paths: Sequence[str | Path]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in paths:
        text = Path(path).read_text()
        if str(path).endswith(".jsonl"):
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
        else:
            rows += json.loads(text).get("benchmarks", [])
    return rows


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cs336_systems.report.parallelism", description=__doc__)
    parser.add_argument("json", nargs="*", help="pytest-benchmark JSON (for C and W); none: defaults")
    parser.add_argument("--out", default="report", help="output directory (default: ./report)")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    section = parallelism_section(_load_rows(args.json), out)
    (out / "parallelism.md").write_text(section)
    print(f"wrote {out / 'parallelism.md'} and {out / 'plots' / PLOT_NAME}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
