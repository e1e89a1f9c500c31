"""pytest-benchmark JSON -> the writeup's tables, plots and ``writeup.md`` (D21).

    python -m cs336_systems.report out.json [more.json ...] [--format md|latex] [--out DIR]

Several JSON files (one per GPU kind, say) are merged; every row keeps the device it ran on. For each
benchmark group it writes ``DIR/tables/<group>.md`` (or ``.tex``): the rows with the parametrize
arguments as index columns and the extra_info numbers as value columns ("mean ± std" where a std
exists, "OOM" for out-of-memory rows), plus, for the groups the handout asks about, a pivoted view
(e.g. D11: one column per implementation and pass). Plots go to ``DIR/plots/`` and ``DIR/writeup.md``
stitches tables, plots and the closed-form answers of :mod:`cs336_systems.accounting` (Markdown
whatever ``--format`` says: the format applies to the table files).

The numbers a bench records in extra_info are authoritative (``mean_ms``/``std_ms``...); pytest-
benchmark's own stats are used only when a case records no ``mean_ms``. Unknown groups and unknown
extra_info keys still get a generic table, so a new bench shows up without touching this file.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pandas as pd

from cs336_systems import accounting
from cs336_systems.model import PRESETS

# ----------------------------------------------------------------------------------------- loading

# Parameter-like keys, in the order they become index columns.
PARAM_ORDER = (
    "device",
    "source",
    "size",
    "ctx",
    "batch",
    "attention",
    "dtype",
    "compile",
    "mode",
    "impl",
    "variant",
    "backend",
    "world_size",
    "nbytes",
    "bucket_mb",
    "d",
    "seq",
    "pass_",
    "causal",
    "warmup",
)

# Value keys in the order they become columns, with their headers.
VALUE_LABELS = {
    "mean_ms": "mean ± std (ms)",
    "median_ms": "median (ms)",
    "do_bench_ms": "do_bench median (ms)",
    "fwd_ms": "fwd (ms)",
    "bwd_ms": "bwd (ms)",
    "fwd_bwd_ms": "fwd+bwd (ms)",
    "max_ms": "max over ranks (ms)",
    "comm_ms": "comm (ms)",
    "comm_share": "comm share",
    "overlap_share": "overlap",
    "tokens_per_s": "tokens/s",
    "model_flops": "model FLOPs",
    "tflops": "TFLOP/s",
    "mfu": "MFU",
    "algbw_gbps": "algbw (GB/s)",
    "busbw_gbps": "busbw (GB/s)",
    "peak_memory_mib": "peak mem (MiB)",
    "mem_before_bwd_mib": "mem before bwd (MiB)",
    "saved_for_bwd_mib": "saved for bwd (MiB)",
    "params_mib": "params (MiB)",
    "grads_mib": "grads (MiB)",
    "optim_state_mib": "optimizer state (MiB)",
    "peak_after_init_mib": "peak after init (MiB)",
    "peak_before_step_mib": "peak before step (MiB)",
    "peak_after_step_mib": "peak after step (MiB)",
}
STATS_MEAN = "stats_mean_ms"  # pytest-benchmark's own timing, used when extra_info has no mean_ms
VALUE_LABELS[STATS_MEAN] = "mean ± std (ms, pytest-benchmark)"
FRACTION_KEYS = {"mfu"}  # and every key with "share" in it
NOT_VALUES = {"oom", "skipped", "device_name"}
MISSING = "—"


@dataclass
class Record:
    """One benchmark case of one JSON file."""

    group: str
    name: str
    source: str
    device: str  # extra_info device_name ("" until _mark_provenance fills it in)
    machine: str  # pytest-benchmark's machine_info of the file
    descriptors: dict[str, Any]  # parameters (and parameter-like extra_info) of the case
    values: dict[str, float]  # numeric extra_info (+ pytest-benchmark stats when nothing else)
    texts: dict[str, str] = field(default_factory=dict)  # string extra_info (kernel names, status...)
    oom: bool = False
    skipped: str | None = None


@dataclass
class Run:
    """Top-level facts of one JSON file."""

    path: Path
    source: str
    datetime: str
    commit: str
    version: str
    machine: str
    devices: set[str] = field(default_factory=set)


def _std_key(key: str, extra: dict[str, Any]) -> str | None:
    """The extra_info key holding the standard deviation that goes with ``key`` (if any)."""
    if key == "mean_ms":
        candidates = ["std_ms"]
    elif key == STATS_MEAN:
        candidates = ["stats_std_ms"]
    elif key.endswith("_ms"):
        stem = key[: -len("_ms")]
        candidates = [f"{stem}_std_ms", f"{key}_std", f"std_{key}"]
    else:
        candidates = [f"{key}_std"]
    return next((c for c in candidates if c in extra), None)


def _machine_name(machine_info: dict[str, Any]) -> str:
    cpu = machine_info.get("cpu", {}) or {}
    brand = cpu.get("brand_raw") or machine_info.get("processor") or machine_info.get("machine") or "?"
    return f"{brand} ({machine_info.get('node', '?')})"


def _record(bench: dict[str, Any], source: str, machine: str) -> Record:
    params = dict(bench.get("params") or {})
    extra = dict(bench.get("extra_info") or {})
    # Parameters, and extra_info copies of parameter-like keys (dtype, batch...), index the rows.
    descriptors = dict(params)
    descriptors.update({k: v for k, v in extra.items() if k in PARAM_ORDER and k not in descriptors})
    values: dict[str, float] = {}
    texts: dict[str, str] = {}
    for key, value in extra.items():
        if key in descriptors or key in NOT_VALUES:
            continue
        if isinstance(value, int | float) and not isinstance(value, bool):
            values[key] = float(value)
        elif isinstance(value, str):
            texts[key] = value
    oom = bool(extra.get("oom", False))
    skipped = extra.get("skipped")
    stats = bench.get("stats") or {}
    if "mean_ms" not in values and not oom and not skipped and "mean" in stats:
        values[STATS_MEAN] = stats["mean"] * 1e3
        values["stats_std_ms"] = stats.get("stddev", 0.0) * 1e3
    return Record(
        group=bench.get("group") or "ungrouped",
        name=bench.get("name", "?"),
        source=source,
        device=str(extra.get("device_name") or ""),
        machine=machine,
        descriptors=descriptors,
        values=values,
        texts=texts,
        oom=oom,
        skipped=str(skipped) if skipped else None,
    )


def load(paths: Sequence[str | Path]) -> tuple[list[Run], list[Record]]:
    """Read pytest-benchmark JSON files; a file that is not one fails with its name in the message."""
    runs, records = [], []
    paths = [Path(p) for p in paths]
    stems = [p.stem for p in paths]
    for path in paths:
        # The file stem names the source, unless two files share it (h100/model.json, h200/model.json).
        source = path.stem if stems.count(path.stem) == 1 else str(path)
        try:
            text = path.read_text()
            # A .jsonl row log (CS336_BENCH_JSONL) holds one benchmark entry per line: what a sweep
            # had finished when its command was cut off.
            if path.suffix == ".jsonl":
                data = {"benchmarks": [json.loads(line) for line in text.splitlines() if line.strip()]}
            else:
                data = json.loads(text)
        except FileNotFoundError:
            raise FileNotFoundError(f"no such benchmark JSON: {path}") from None
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(data, dict) or "benchmarks" not in data:
            raise ValueError(f"{path} is not pytest-benchmark JSON (no 'benchmarks' key)")
        machine = _machine_name(data.get("machine_info") or {})
        commit = data.get("commit_info") or {}
        run = Run(
            path=path,
            source=source,
            datetime=str(data.get("datetime", "?")),
            commit=(str(commit.get("id") or "?")[:10] + (" (dirty)" if commit.get("dirty") else "")),
            version=str(data.get("version", "?")),
            machine=machine,
        )
        for bench in data["benchmarks"]:
            records.append(_record(bench, source, machine))
        runs.append(run)
    _mark_provenance(records)
    for run in runs:
        run.devices = {r.device for r in records if r.source == run.source}
    return runs, records


def _mark_provenance(records: list[Record]) -> None:
    """Make merged rows distinguishable: the device always, the source file when the same case on the
    same device comes from several files. A row without a device_name (an OOM or unsupported row, say)
    takes the one its file's group names elsewhere, else the machine of its file."""
    named: dict[tuple[str, str], set[str]] = {}
    for r in records:
        if r.device:
            named.setdefault((r.source, r.group), set()).add(r.device)
    for r in records:
        if not r.device:
            devices = named.get((r.source, r.group), set())
            r.device = next(iter(devices)) if len(devices) == 1 else r.machine
    seen: dict[tuple[str, str, str], set[str]] = {}
    for r in records:
        seen.setdefault((r.group, r.name, r.device), set()).add(r.source)
    clash = any(len(sources) > 1 for sources in seen.values())
    for r in records:
        r.descriptors["device"] = r.device
        if clash:
            r.descriptors["source"] = r.source


# -------------------------------------------------------------------------------------- formatting


def parse_size(value: Any) -> float | None:
    """Bytes of a size given as a number or a string like "1MB", "10 MiB", "1GB" (MB = 10⁶, MiB = 2²⁰)."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    m = re.fullmatch(r"\s*([\d.]+)\s*([KMGT]?)(i?)B?\s*", str(value), re.IGNORECASE)
    if not m:
        return None
    number, prefix, binary = float(m.group(1)), m.group(2).upper(), bool(m.group(3))
    power = "KMGT".index(prefix) + 1 if prefix else 0
    return number * (1024 if binary else 1000) ** power


def format_size(nbytes: float) -> str:
    for unit, base in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= base and nbytes % base == 0:
            return f"{nbytes / base:g} {unit}"
    for unit, base in (("GB", 10**9), ("MB", 10**6), ("kB", 10**3)):
        if nbytes >= base:
            return f"{nbytes / base:g} {unit}"
    return f"{nbytes:g} B"


def format_number(key: str, value: float) -> str:
    if math.isnan(value):
        return MISSING
    if key in FRACTION_KEYS or "share" in key:
        return f"{100 * value:.1f}%"
    if value.is_integer() and abs(value) < 1e15:
        return f"{int(value):,}"
    if key == "model_flops":
        return f"{value:.3g}"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    size = abs(value)
    if size >= 1000:
        return f"{value:,.0f}"
    if size >= 100:
        return f"{value:.1f}"
    if size >= 10:
        return f"{value:.2f}"
    if size >= 1 or size == 0:
        return f"{value:.3f}"
    return f"{value:.3g}"


def format_param(key: str, value: Any) -> str:
    if value is None:
        return MISSING
    if isinstance(value, float) and key not in PARAM_ORDER:
        return format_number(key, value)
    if key == "nbytes" and isinstance(value, int | float):  # a label like "1MB" stays as the bench wrote it
        return format_size(value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


# Values that read better in pipeline order than alphabetically.
VALUE_ORDER = {"fwd": 0, "bwd": 1, "fwd_bwd": 2, "train": 3, "eager": 0, "compiled": 1, "fp32": 0, "bf16": 1}


def _sort_key(key: str, value: Any) -> tuple[int, Any, str]:
    if key == "nbytes" and parse_size(value) is not None:
        return (0, parse_size(value), "")
    if isinstance(value, int | float) and not isinstance(value, bool):
        return (0, value, "")
    return (1, VALUE_ORDER.get(str(value), len(VALUE_ORDER)), str(value))


def _header(key: str) -> str:
    return {"pass_": "pass"}.get(key, key)


# -------------------------------------------------------------------------------------------- tables


@dataclass(frozen=True)
class PivotSpec:
    """A handout-shaped view of a group: ``columns`` parameters spread across, ``values`` shown."""

    columns: tuple[tuple[str, ...], ...]  # each entry: alternative parameter names, first present wins
    values: tuple[str, ...]  # value keys, the present ones shown


# group-name pattern -> the view the handout asks for (first match wins)
PIVOTS: tuple[tuple[str, PivotSpec], ...] = (
    (r"^D2\b.*warm", PivotSpec((("warmup",),), ("mean_ms", STATS_MEAN))),
    (r"^D2\b", PivotSpec((("mode", "pass_"),), ("mean_ms", STATS_MEAN))),
    (r"^D4\b", PivotSpec((("dtype",),), ("mean_ms", STATS_MEAN))),
    (r"^D5\b", PivotSpec((("mode", "pass_"),), ("peak_memory_mib",))),
    (r"^D6|^D7a", PivotSpec((("impl",),), ("fwd_ms", "bwd_ms", "mem_before_bwd_mib"))),
    (r"^D7b?\b", PivotSpec((("compile",),), ("mean_ms", STATS_MEAN))),
    (r"^D11\b", PivotSpec((("impl",), ("pass_", "mode")), ("do_bench_ms",))),
    (r"^D13\b", PivotSpec((("nbytes",),), ("mean_ms", "max_ms"))),
)


@dataclass
class GroupTable:
    """The tables of one benchmark group, as DataFrames of strings."""

    group: str
    long: pd.DataFrame
    pivot: pd.DataFrame | None
    fixed: dict[str, Any]  # descriptors constant across the group
    records: list[Record]
    index_columns: int = 0  # the leading columns of ``long`` that name the case
    varying: list[str] = field(default_factory=list)
    value_keys: list[str] = field(default_factory=list)

    def view(self, spec: PivotSpec) -> pd.DataFrame | None:
        """Another pivot of the same rows (a group serving several deliverables, e.g. D2/D4/D7b)."""
        return _pivot(self.group, self.records, self.varying, self.value_keys, spec)

    @property
    def slug(self) -> str:
        return re.sub(r"[^a-z0-9]+", "-", self.group.lower()).strip("-") or "group"

    @property
    def caption(self) -> str:
        fixed = ", ".join(f"{_header(k)}={format_param(k, v)}" for k, v in self.fixed.items())
        return f"{self.group}" + (f" (fixed: {fixed})" if fixed else "")


def _value_keys(records: list[Record]) -> list[str]:
    """Value columns of a group: the known keys in VALUE_LABELS order, then unknown ones by name; keys
    that are the std of another key are shown inside that key's cell, not as columns."""
    present = {key for r in records for key in (*r.values, *r.texts)}
    std_keys = {std for r in records for key in r.values if (std := _std_key(key, r.values))}
    known = [k for k in VALUE_LABELS if k in present and k not in std_keys]
    unknown = sorted(k for k in present if k not in VALUE_LABELS and k not in std_keys)
    return known + unknown


def _constant_setup(records: list[Record], keys: list[str]) -> dict[str, Any]:
    """Unknown value keys with one value across a group of several rows (warm-up steps, global batch,
    a status): shown once in the caption instead of as a column."""
    if len(records) < 2:
        return {}
    fixed = {}
    for key in keys:
        if key in VALUE_LABELS:
            continue
        seen = {repr(r.values.get(key, r.texts.get(key))) for r in records if not r.oom}
        if len(seen) == 1:
            first = next(r for r in records if not r.oom)
            fixed[key] = first.texts[key] if key in first.texts else first.values.get(key)
    return fixed


def _cell(record: Record, key: str) -> str:
    if record.oom:
        return "OOM"
    if record.skipped:
        return "skipped"
    status = record.texts.get("status", "ok")
    if status != "ok" and key not in record.texts:  # "unsupported", "skipped", "error": say so in every cell
        return status
    if key in record.texts:
        return record.texts[key]
    if key not in record.values:
        return MISSING
    text = format_number(key, record.values[key])
    std = _std_key(key, record.values)
    if std:
        text += f" ± {format_number(key, record.values[std])}"
    return text


def _ordered_descriptors(records: list[Record]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        keys.update(dict.fromkeys(r.descriptors))
    order = {k: i for i, k in enumerate(PARAM_ORDER)}
    return sorted(keys, key=lambda k: (order.get(k, len(order)), k))


def build_group_table(group: str, records: list[Record]) -> GroupTable:
    descriptors = _ordered_descriptors(records)
    fixed, varying = {}, []
    for key in descriptors:
        seen = {repr(r.descriptors.get(key)) for r in records}
        if len(seen) == 1:
            fixed[key] = records[0].descriptors.get(key)
        else:
            varying.append(key)
    records = sorted(records, key=lambda r: tuple(_sort_key(k, r.descriptors.get(k)) for k in varying))
    value_keys = _value_keys(records)
    setup = _constant_setup(records, value_keys)
    value_keys = [k for k in value_keys if k not in setup]
    fixed.update({k: v for k, v in setup.items() if v is not None})
    notes = any(r.skipped for r in records)
    rows = []
    for r in records:
        row = {_header(k): format_param(k, r.descriptors.get(k)) for k in varying}
        row.update({VALUE_LABELS.get(k, k): _cell(r, k) for k in value_keys})
        if notes:
            row["note"] = r.skipped or ""
        rows.append(row)
    long = pd.DataFrame(rows) if rows else pd.DataFrame()
    pivot = _pivot(group, records, varying, value_keys)
    return GroupTable(group, long, pivot, fixed, records, len(varying), varying, value_keys)


def _pivot(
    group: str,
    records: list[Record],
    varying: list[str],
    value_keys: list[str],
    spec: PivotSpec | None = None,
) -> pd.DataFrame | None:
    """The handout-shaped view of a group: ``spec``, or the first of PIVOTS matching the group name."""
    spec = spec or next((s for pattern, s in PIVOTS if re.search(pattern, group)), None)
    if spec is None:
        return None
    columns = [next((c for c in alts if c in varying), None) for alts in spec.columns]
    columns = [c for c in columns if c is not None]
    values = [v for v in spec.values if v in value_keys]
    if not columns or not values:
        return None
    index = [k for k in varying if k not in columns]
    cells: dict[tuple, dict[str, str]] = {}
    col_order: dict[str, tuple] = {}  # label -> sort key: value first, then the spread parameters
    for r in records:  # already sorted by the varying descriptors: rows come out in order
        row_key = tuple(format_param(k, r.descriptors.get(k)) for k in index)
        col_key = " / ".join(format_param(k, r.descriptors.get(k)) for k in columns)
        col_sort = tuple(_sort_key(k, r.descriptors.get(k)) for k in columns)
        row = cells.setdefault(row_key, {})
        for i, v in enumerate(values):
            label = col_key if len(values) == 1 else f"{VALUE_LABELS.get(v, v)}: {col_key}"
            row[label] = _cell(r, v)
            col_order[label] = (i, col_sort)
    col_order = dict(sorted(col_order.items(), key=lambda kv: kv[1]))
    rows = []
    for row_key, row in cells.items():
        out = {_header(k): v for k, v in zip(index, row_key, strict=True)}
        out.update({c: row.get(c, MISSING) for c in col_order})
        rows.append(out)
    frame = pd.DataFrame(rows)
    what = ", ".join(VALUE_LABELS.get(v, v) for v in values)
    frame.attrs["title"] = f"{what} by {' / '.join(_header(c) for c in columns)}"
    return frame


def build_tables(records: list[Record]) -> list[GroupTable]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return [build_group_table(g, rs) for g, rs in groups.items()]


def to_markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_(no rows)_"
    return frame.to_markdown(index=False, disable_numparse=True)


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_"}
_LATEX_ESCAPES.update({"{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"})


def _latex_escape(text: str) -> str:
    out = "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))
    return out.replace("±", r"$\pm$").replace("—", "--").replace("·", r"$\cdot$")


def to_latex(frame: pd.DataFrame, caption: str) -> str:
    """A booktabs table; cells are escaped here so ``±`` becomes ``$\\pm$`` (pdflatex-safe)."""
    if frame.empty:
        return f"% {caption}: no rows\n"
    escaped = frame.map(_latex_escape)
    escaped.columns = [_latex_escape(c) for c in frame.columns]
    try:
        body = escaped.to_latex(index=False, escape=False)  # needs jinja2 (pandas Styler)
    except ImportError:
        from tabulate import tabulate

        # latex_raw: the cells are escaped above already.
        body = tabulate(escaped.values.tolist(), headers=list(escaped.columns), tablefmt="latex_raw") + "\n"
    return (
        "\\begin{table}[ht]\n\\centering\n\\small\n"
        + body
        + f"\\caption{{{_latex_escape(caption)}}}\n\\end{{table}}\n"
    )


def readable(frame: pd.DataFrame, index_cols: int) -> pd.DataFrame:
    """A table with many value columns and few rows reads better turned on its side: one row per
    quantity, one column per case (named by its index columns)."""
    if frame.empty or len(frame) > 6 or frame.shape[1] - index_cols <= 12:
        return frame
    names = [
        ", ".join(f"{c}={row[c]}" for c in frame.columns[:index_cols]) or f"case {i + 1}"
        for i, (_, row) in enumerate(frame.iterrows())
    ]
    body = frame.iloc[:, index_cols:].T
    body.columns = names if len(set(names)) == len(names) else [f"{i + 1}: {n}" for i, n in enumerate(names)]
    return body.rename_axis("quantity").reset_index()


def render_group_markdown(table: GroupTable) -> str:
    parts = [f"### {table.group}", "", f"_{table.caption}_", ""]
    if table.pivot is not None:
        parts += [f"**{table.pivot.attrs.get('title', 'view')}**", "", to_markdown(table.pivot), ""]
        parts += [
            "<details><summary>all columns</summary>",
            "",
            to_markdown(table.long),
            "",
            "</details>",
            "",
        ]
    else:
        parts += [to_markdown(readable(table.long, table.index_columns)), ""]
    return "\n".join(parts)


def render_group_latex(table: GroupTable) -> str:
    parts = [f"% {table.group} (generated by cs336_systems.report)"]
    if table.pivot is not None:
        parts.append(to_latex(table.pivot, f"{table.caption}: {table.pivot.attrs.get('title', '')}"))
    long = table.long if table.pivot is not None else readable(table.long, table.index_columns)
    parts.append(to_latex(long, table.caption))
    return "\n".join(parts)


# --------------------------------------------------------------------------------------------- plots


def _records_in(records: Iterable[Record], pattern: str) -> list[Record]:
    return [r for r in records if re.search(pattern, r.group)]


def _numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _line_plot(
    path: Path,
    panels: dict[str, dict[str, list[tuple[float, float]]]],
    xlabel: str,
    ylabel: str,
    title: str,
    x_base: int = 2,
) -> Path | None:
    """One subplot per panel, one line per series, log-log axes."""
    panels = {k: v for k, v in panels.items() if any(len(pts) for pts in v.values())}
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, (panel, series) in zip(axes.flat, panels.items(), strict=False):
        for label, points in series.items():
            points = sorted(points)
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=x_base)
        ax.set_yscale("log")
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label(r: Record, keys: Sequence[str], multi_device: bool) -> str:
    parts = [f"{_header(k)}={format_param(k, r.descriptors[k])}" for k in keys if k in r.descriptors]
    if multi_device:
        parts.append(r.device)
    return ", ".join(parts)


def _message_bytes(r: Record) -> float | None:
    """All-reduce size: extra_info ``bytes`` when recorded (exact), else the ``nbytes`` label parsed."""
    return r.values.get("bytes") or parse_size(r.descriptors.get("nbytes"))


def plot_allreduce(records: list[Record], out: Path) -> Path | None:
    """D13: latency vs size, one line per backend and world size (max over ranks where recorded)."""
    rows = [r for r in _records_in(records, r"^D13\b") if not r.oom and not r.skipped]
    multi = len({r.device for r in rows}) > 1
    key = "max_ms" if any("max_ms" in r.values for r in rows) else "mean_ms"
    series: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        size = _message_bytes(r)
        if size is None or key not in r.values:
            continue
        series.setdefault(_label(r, ("backend", "world_size"), multi), []).append((size, r.values[key]))
    ylabel = "max over ranks (ms)" if key == "max_ms" else "mean (ms)"
    return _line_plot(out, {"all-reduce": series}, "bytes per rank", ylabel, "D13 all-reduce latency", 10)


def plot_attention(records: list[Record], out: Path) -> Path | None:
    """D6/D7a: forward and backward time vs seq, one line per implementation and head dim."""
    rows = [r for r in _records_in(records, r"^D6|^D7a") if not r.oom and not r.skipped]
    multi = len({r.device for r in rows}) > 1
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for key, title in (("fwd_ms", "forward (ms per pass)"), ("bwd_ms", "backward (ms per pass)")):
        for r in rows:
            seq = _numeric(r.descriptors.get("seq"))
            if seq is None or key not in r.values:
                continue
            label = _label(r, ("impl", "d"), multi)
            panels.setdefault(title, {}).setdefault(label, []).append((seq, r.values[key]))
    return _line_plot(out, panels, "seq", "ms", "D6/D7a attention time vs sequence length")


def plot_flash(records: list[Record], out: Path) -> Path | None:
    """D11: do_bench time vs seq, one panel per dtype and head dim, one line per implementation; the
    fwd_bwd pass when the sweep has passes."""
    rows = [r for r in _records_in(records, r"^D11\b") if not r.oom and not r.skipped]
    pass_key = next((k for k in ("pass_", "mode") if any(k in r.descriptors for r in rows)), None)
    if pass_key and any(r.descriptors.get(pass_key) == "fwd_bwd" for r in rows):
        rows = [r for r in rows if r.descriptors.get(pass_key) == "fwd_bwd"]
    multi = len({r.device for r in rows}) > 1
    key = "do_bench_ms" if any("do_bench_ms" in r.values for r in rows) else "mean_ms"
    panels: dict[str, dict[str, list[tuple[float, float]]]] = {}
    for r in sorted(
        rows, key=lambda r: (str(r.descriptors.get("dtype")), _numeric(r.descriptors.get("d")) or 0)
    ):
        seq = _numeric(r.descriptors.get("seq"))
        if seq is None or key not in r.values:
            continue
        panel = _label(r, ("dtype", "d"), False) or "all"
        panels.setdefault(panel, {}).setdefault(_label(r, ("impl",), multi), []).append((seq, r.values[key]))
    title = "D11 FlashAttention sweep" + (" (fwd+bwd)" if pass_key else "")
    return _line_plot(out, panels, "seq", VALUE_LABELS[key].replace(" ± std", ""), title)


PLOTS: tuple[tuple[str, str, Callable[[list[Record], Path], Path | None]], ...] = (
    ("D13", "allreduce.png", plot_allreduce),
    ("D6", "attention.png", plot_attention),
    ("D11", "flash.png", plot_flash),
)


# ------------------------------------------------------------------------------ data-driven answers


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
    for r in _records_in(records, r"^D6|^D7a"):
        impl = str(r.descriptors.get("impl", "pytorch"))
        seq, d = _numeric(r.descriptors.get("seq")), _numeric(r.descriptors.get("d"))
        if r.oom and impl == "pytorch" and seq is not None and d is not None:
            cases.append((int(seq), int(d)))
    return min(cases) if cases else None


def d6_memory_check(records: list[Record]) -> str:
    """Measured memory vs the accounting, per D6/D7a row: how many (batch, seq, seq) fp32 matrices the
    implementation really keeps for backward. Uses ``saved_for_bwd_mib`` (allocated after the forward
    minus before it: the output O plus what autograd saved) where the bench records it, else
    ``mem_before_bwd_mib`` (which also holds q, k, v and the incoming gradient dO)."""
    lines = []
    for r in _records_in(records, r"^D6|^D7a"):
        seq, d = _numeric(r.descriptors.get("seq")), _numeric(r.descriptors.get("d"))
        if r.oom or r.skipped or seq is None or d is None:
            continue
        batch = int(_numeric(r.descriptors.get("batch")) or accounting.D6_BATCH)
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
    rows = _records_in(records, r"^D6|^D7a")
    devices = sorted({r.device for r in rows})
    capacity = device_capacity_bytes(devices[0]) if devices else accounting.H100_BYTES
    measured = smallest_measured_oom(records)
    causal = any(r.descriptors.get("causal") is True for r in rows)
    parts = [accounting.render_d6(capacity, measured_oom=measured, causal=causal)]
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
    for r in _records_in(records, r"^D20"):
        size, world = r.descriptors.get("size"), _numeric(r.descriptors.get("world_size"))
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
    for r in _records_in(records, r"^D13\b"):
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
    rows = [r for r in _records_in(records, r"^D11\b") if not r.oom and not r.skipped]
    pass_key = next((k for k in ("pass_", "mode") if any(k in r.descriptors for r in rows)), None)
    if pass_key:
        rows = [r for r in rows if r.descriptors.get(pass_key) in ("fwd_bwd", None)]
    key = "do_bench_ms" if any("do_bench_ms" in r.values for r in rows) else "mean_ms"
    table: dict[tuple[str, str, str], dict[str, dict[float, float]]] = {}
    for r in rows:
        impl = str(r.descriptors.get("impl", ""))
        kind = "ours" if "triton" in impl else "pytorch" if impl == "pytorch" else None
        seq = _numeric(r.descriptors.get("seq"))
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


# -------------------------------------------------------------------------------------------- writeup


@dataclass(frozen=True)
class Section:
    key: str
    title: str
    asks: str
    bench: str  # where the numbers come from
    matches: Callable[[int, str], bool]  # (deliverable number, letter) -> belongs here


SECTIONS = (
    Section(
        "D2",
        "1.1.3 End-to-end benchmarking (benchmarking_script, D2)",
        "Forward and forward+backward time per Table 1 size (5 warm-ups, 10 timed steps, mean ± std), and "
        "the effect of 0 / 1 / 2 warm-up steps.",
        "bench/bench_model.py",
        lambda n, x: n == 2,
    ),
    Section(
        "D3",
        "1.1.4 Nsight Systems profile (nsys_profile, D3)",
        "Top kernels of forward and of training step, matmul share, softmax vs matmul inside attention.",
        "bench/bench_profile.py or `python -m cs336_systems.benchmark --profile DIR`",
        lambda n, x: n == 3,
    ),
    Section(
        "D4",
        "1.1.5 Mixed precision (benchmarking_mixed_precision, D4)",
        "fp32 vs bf16 autocast timings per size.",
        "bench/bench_model.py",
        lambda n, x: n == 4,
    ),
    Section(
        "D5",
        "1.1.6 Memory profiling (memory_profiling, D5)",
        "Peak memory of the 2.7B model per context length, forward and full training step, fp32 and bf16; "
        "the residual-stream tensor size.",
        "bench/bench_model.py",
        lambda n, x: n == 5,
    ),
    Section(
        "D6",
        "1.2.1 PyTorch attention and torch.compile'd attention (pytorch_attention, torch_compile (a); D6, D7a)",
        "Timings of 100 forward and 100 backward passes, memory before backward, OOM cases, the memory "
        "accounting of the smallest OOM case.",
        "bench/bench_attention.py",
        lambda n, x: n == 6 or (n == 7 and x == "a"),
    ),
    Section(
        "D7b",
        "Compiled whole model (torch_compile (b), D7b)",
        "Vanilla vs torch.compile'd Transformer: forward, and forward+backward+optimizer step.",
        "bench/bench_model.py",
        lambda n, x: n == 7,
    ),
    Section(
        "D11",
        "1.3.2 FlashAttention-2 benchmark (flash_benchmarking, D11)",
        "Forward, backward and end-to-end latencies of our Triton FlashAttention-2 vs PyTorch, batch 1, "
        "causal, seq 128..65536, d 16..128, bf16 and fp32 (triton.testing.do_bench).",
        "bench/bench_flash.py",
        lambda n, x: n == 11,
    ),
    Section(
        "D12",
        "1.3.3 Leaderboard case (D12)",
        "batch 1 × 16 heads, seq 16384, d_head 64, bf16, causal, forward+backward.",
        "bench/bench_flash.py",
        lambda n, x: n == 12,
    ),
    Section(
        "D13",
        "2.1 All-reduce (distributed_communication_single_node, D13)",
        "All-reduce latency for gloo+CPU and nccl+GPU, 1 MB–1 GB, 2/4/6 processes.",
        "bench/bench_allreduce.py",
        lambda n, x: n == 13,
    ),
    Section(
        "D14",
        "2.2–2.3 DDP variants (naive, flat, overlapped, bucketed; D14–D17)",
        "Time per training step and time communicating gradients, xl, 2 GPUs; bucket sizes 1–1000 MB; the "
        "overhead model of 2.3.3(b).",
        "bench/bench_ddp.py",
        lambda n, x: 14 <= n <= 17,
    ),
    Section(
        "D18",
        "2.4 Communication accounting (communication_accounting, D18)",
        "The XXL model: memory, FSDP shards on TPU v5p, compute-bound batch, and how to shrink the batch.",
        "closed form (accounting.py)",
        lambda n, x: n == 18,
    ),
    Section(
        "D20",
        "3 Optimizer state sharding (optimizer_state_sharding_accounting, D20)",
        "Peak memory after init / before / after the step with and without sharding, time per step, and "
        "how our sharding differs from ZeRO stage 1.",
        "bench/bench_sharding.py",
        lambda n, x: n in (19, 20),
    ),
)


def sections_of(group: str) -> list[str]:
    """Writeup sections a group serves, from the deliverable ids that start its name: "D6/D7a ..." ->
    [D6]; "D2/D4/D7b model small" -> [D2, D4, D7b]; "D14-D17 DDP" -> [D14]."""
    head = group.split(" ", 1)[0]
    if not re.match(r"^D\d", head):
        return []
    keys: list[str] = []
    for number, letter in re.findall(r"D(\d+)([a-z]?)", head):
        n = int(number)
        key = next((s.key for s in SECTIONS if s.matches(n, letter)), None)
        if key is not None and key not in keys:
            keys.append(key)
    return keys


def section_of(group: str) -> str | None:
    """The section whose table a group is (the first deliverable in its name)."""
    keys = sections_of(group)
    return keys[0] if keys else None


# What a group shows in a further section it serves (its own table sits in the first one).
SECTION_VIEWS = {
    "D4": PivotSpec((("dtype",),), ("mean_ms", STATS_MEAN)),
    "D7b": PivotSpec((("compile",),), ("mean_ms", STATS_MEAN)),
}


def _accounting_for(section: str, records: list[Record]) -> str:
    if section == "D5":
        return accounting.render_d5()
    if section == "D6":
        return d6_answer(records)
    if section == "D11":
        return flash_speedups(records)
    if section == "D14":
        fit = allreduce_fit(records)
        o, w, source = fit or spec_allreduce_fit()
        if fit is None and _records_in(records, r"^D13\b"):
            source += ", as the D13 rows here do not resolve a per-call cost"
        s = accounting.model_memory(PRESETS["xl"]).grads  # fp32 gradients of xl
        return accounting.render_d17(s, w, o, f"xl fp32 gradients; w and o from the {source}")
    if section == "D18":
        return accounting.render_d18()
    if section == "D20":
        return "\n\n".join(p for p in (d20_check(records), accounting.render_d20()) if p)
    return ""


def build_writeup(runs: list[Run], tables: list[GroupTable], plots: dict[str, Path], out: Path) -> str:
    records = [r for t in tables for r in t.records]
    by_section: dict[str | None, list[GroupTable]] = {}
    also: dict[str, list[GroupTable]] = {}  # groups whose own table is in another section
    for t in tables:
        keys = sections_of(t.group)
        by_section.setdefault(keys[0] if keys else None, []).append(t)
        for key in keys[1:]:
            also.setdefault(key, []).append(t)
    lines = [
        "# CS336 assignment 2 (systems): results",
        "",
        "Generated by `python -m cs336_systems.report` from pytest-benchmark JSON. Every table comes from "
        "the benches under `bench/`; closed-form answers come from `cs336_systems.accounting`.",
        "",
        "| JSON | date | commit | pytest-benchmark | devices |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        devices = ", ".join(sorted(run.devices)) or run.machine
        lines.append(f"| `{run.path.name}` | {run.datetime} | {run.commit} | {run.version} | {devices} |")
    lines.append("")
    for section in SECTIONS:
        groups = by_section.get(section.key, [])
        extra = _accounting_for(section.key, records)
        lines += [f"## {section.title}", "", f"_Asked:_ {section.asks}", ""]
        views = [(t, t.view(SECTION_VIEWS[section.key])) for t in also.get(section.key, [])]
        views = [(t, v) for t, v in views if v is not None and section.key in SECTION_VIEWS]
        if not groups and not views and section.key != "D18":
            lines += [f"No rows for this part in the given JSON (bench: {section.bench}).", ""]
        for t in groups:
            lines += [render_group_markdown(t)]
        for t, view in views:
            lines += [
                f"### {t.group}: {view.attrs['title']}",
                "",
                f"_{t.caption}_",
                "",
                to_markdown(view),
                "",
            ]
        for key, path in plots.items():
            if key == section.key:
                lines += [f"![{key}]({path.relative_to(out).as_posix()})", ""]
        if extra:
            lines += [extra, ""]
    others = by_section.get(None, [])
    if others:
        lines += ["## Other benchmark groups", ""]
        lines += [render_group_markdown(t) for t in others]
    return "\n".join(lines).rstrip() + "\n"


def write_report(paths: Sequence[str | Path], out: str | Path, fmt: str = "md") -> dict[str, Any]:
    """Read the JSON files and write tables, plots and writeup.md under ``out``; returns what it wrote."""
    if fmt not in ("md", "latex"):
        raise ValueError(f"format must be 'md' or 'latex', got {fmt!r}")
    out = Path(out)
    runs, records = load(paths)
    tables = build_tables(records)
    table_dir = out / "tables"
    table_dir.mkdir(parents=True, exist_ok=True)
    written_tables = []
    for t in tables:
        if fmt == "md":
            path = table_dir / f"{t.slug}.md"
            path.write_text(render_group_markdown(t))
        else:
            path = table_dir / f"{t.slug}.tex"
            path.write_text(render_group_latex(t))
        written_tables.append(path)
    plots = {}
    for section, name, plot in PLOTS:
        path = plot(records, out / "plots" / name)
        if path is not None:
            plots[section] = path
    writeup = out / "writeup.md"
    writeup.write_text(build_writeup(runs, tables, plots, out))
    return {
        "tables": written_tables,
        "plots": list(plots.values()),
        "writeup": writeup,
        "records": len(records),
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cs336_systems.report",
        description="pytest-benchmark JSON -> tables, plots, writeup.md",
    )
    parser.add_argument("json", nargs="+", help="pytest-benchmark JSON files (--benchmark-json output)")
    parser.add_argument("--format", choices=("md", "latex"), default="md", help="table files format")
    parser.add_argument("--out", default="report", help="output directory (default: ./report)")
    args = parser.parse_args(argv)
    try:
        result = write_report(args.json, args.out, args.format)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{result['records']} benchmark rows from {len(args.json)} file(s)")
    for path in [*result["tables"], *result["plots"], result["writeup"]]:
        print(f"wrote {path}")
    return 0
