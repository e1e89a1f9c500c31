"""Rows of one benchmark group -> tables: cell formatting, the long table and the handout-shaped pivot."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from cs336_systems.report.load import (
    CONTENTION_KEYS,
    FRACTION_KEYS,
    HOST_TIMER_KEYS,
    MISSING,
    PARAM_ORDER,
    STATS_MEAN,
    VALUE_LABELS,
    Record,
    _std_key,
    figure_verdict,
    is_interpreted,
    unreliable,
)
from cs336_systems.rows.contention import INTERPRETER_NOTE, TIMERS_NOTE, timers_disagree, verdict_label
from cs336_systems.units import parse_size

UNITS = {"ms": "ms", "s": "s", "mib": "MiB", "gib": "GiB", "gbps": "GB/s", "tflops": "TFLOP/s"}


def value_label(key: str) -> str:
    """A value column's header: its label, else its key in words with the unit its suffix names
    (``do_bench_p80_ms``: "do bench p80 (ms)"), never the raw key."""
    if key in VALUE_LABELS:
        return VALUE_LABELS[key]
    *words, last = key.split("_")
    if words and last in UNITS:
        return f"{' '.join(words)} ({UNITS[last]})"
    return key.replace("_", " ")


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


@dataclass(frozen=True)
class PivotSpec:
    """A handout-shaped view of a group: ``columns`` parameters spread across, ``values`` shown."""

    columns: tuple[tuple[str, ...], ...]  # each entry: alternative parameter names, first present wins
    values: tuple[str, ...]  # value keys, the present ones shown


# schema group key -> the view the handout asks for
PIVOTS: dict[str, PivotSpec] = {
    "warmup": PivotSpec((("warmup",),), ("mean_ms", STATS_MEAN)),
    "model": PivotSpec((("mode", "pass_"),), ("mean_ms", STATS_MEAN)),
    "memory": PivotSpec((("mode", "pass_"),), ("peak_memory_mib",)),
    "attention": PivotSpec((("impl",),), ("fwd_ms", "bwd_ms", "mem_before_bwd_mib")),
    "flash_sweep": PivotSpec((("impl",), ("pass_", "mode")), ("do_bench_ms",)),
    "allreduce": PivotSpec((("nbytes",),), ("mean_ms", "max_ms")),
}


@dataclass
class GroupTable:
    """The tables of one benchmark group, as DataFrames of strings."""

    group: str
    group_key: str | None
    long: pd.DataFrame
    pivot: pd.DataFrame | None
    fixed: dict[str, Any]  # descriptors constant across the group
    records: list[Record]
    index_columns: int = 0  # the leading columns of ``long`` that name the case
    varying: list[str] = field(default_factory=list)
    value_keys: list[str] = field(default_factory=list)
    absent: list[str] = field(default_factory=list)  # one line per device: backends it cannot have
    show_unreliable: bool = False  # print unreliable rows' figures, marked, instead of the mark alone

    @property
    def footnotes(self) -> list[str]:
        """What the ``[n]`` markers in this group's cells point to (the view tables' too)."""
        return footnotes(self.records)

    def view(self, spec: PivotSpec) -> pd.DataFrame | None:
        """Another pivot of the same rows (a group serving several deliverables, e.g. D2/D4/D7b)."""
        return _pivot(self.group_key, self.records, self.varying, self.value_keys, spec, self.show_unreliable)

    @property
    def withheld(self) -> bool:
        """Whether no timed figure of the table is a result (a loaded run's tiny-model table was 114
        cells of ``unreliable [1]``, issue 73): the writeup says so in one line instead. False when
        the figures are printed (``show_unreliable``) or the table times nothing."""
        if self.show_unreliable:
            return False
        ran = [r for r in self.records if not r.oom and _not_run(r) is None]
        verdicts = [_verdict(r, k) for r in ran for k in self.value_keys if _timed(k) and k in r.values]
        return bool(verdicts) and all(verdicts)

    def untimed(self) -> pd.DataFrame:
        """The long table's case columns and its columns that time nothing (FLOPs, memory, status)."""
        keep = [value_label(k) for k in self.value_keys if not _timed(k)]
        return self.long.iloc[:, : self.index_columns].join(self.long[[c for c in keep if c in self.long]])

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
    # the reason a case did not run is a footnote, not a column
    present = {key for r in records for key in (*r.values, *r.texts)} - CONTENTION_KEYS - {"reason"}
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


def _not_run(record: Record) -> tuple[str, str | None] | None:
    """(label, reason) of a case that did not run ("unsupported", "skipped", "error"), else None."""
    status = record.texts.get("status", "ok")
    if not record.skipped and status == "ok":
        return None
    return (status if status != "ok" else "skipped"), record.skipped or record.texts.get("reason")


def _is_ratio(key: str) -> bool:
    """A ratio of times (``ratio_to_best_sdpa``, ``vs_torch``, ``time_vs_fsdp2``); memory ratios
    (``extra_mib_vs_full``, ``state_vs_ddp``) are not timings."""
    if "mib" in key or key.startswith("state"):
        return False
    return "ratio" in key or "_vs_" in key or key.startswith("vs_") or "speedup" in key


def _timed_share(key: str) -> bool:
    """A share of a step's time (``comm_share`` = comm_ms / step, ``overlap_share``, the profiler's
    ``matmul_share_forward``): a ratio of times. Shares of memory (``optim_state_share``) are not."""
    return "share" in key and not any(part in key for part in ("state", "mib", "param", "grad"))


def _timed(key: str) -> bool:
    """A value that comes from the row's timing (and is as unreliable as it), ratios of times included."""
    # rates measured by timing too: TFLOP/s (the matmul rate behind MFU included) and every MFU
    timing = key.endswith(("_ms", "_s", "_gbps", "tflops")) or key.startswith("mfu") or key == "tokens_per_s"
    return _is_ratio(key) or _timed_share(key) or (timing and "mib" not in key)


RATIO_NOTE = "ratio not derived: "
IMPL_KEYS = ("impl", "variant", "recipe", "row")  # what differs between the rows a stored ratio compares


def _mark_ratio_sources(records: list[Record]) -> None:
    """A ratio a bench stores on one row (ours / best SDPA, vs torch) compares it with rows of the same
    case that differ only in the implementation: when one of those was timed under contention, the
    ratio is no result either (issue 51). Interpreted rows are left aside: no other row's ratio uses
    them, and their own ratios are marked already."""
    cases: dict[tuple, list[Record]] = {}
    for r in records:
        rest = tuple(sorted((k, repr(v)) for k, v in r.descriptors.items() if k not in IMPL_KEYS))
        cases.setdefault((r.device, rest), []).append(r)
    for rows in cases.values():
        bad = [
            (r, why) for r in rows if not (r.oom or r.skipped or is_interpreted(r)) and (why := unreliable(r))
        ]
        for r in rows:
            source = next(((b, why) for b, why in bad if b is not r), None)
            r.ratio_caveat = (
                f"{RATIO_NOTE}{source[0].name}'s timing is not a result ({source[1]})" if source else None
            )


def _verdict(record: Record, key: str) -> str | None:
    """Why this cell's figure is no result: the row's own verdict, for a ratio its sources', for a
    host-timed figure of a do_bench row the disagreement of its two timers (its do_bench figure stands),
    for a ``mean ± std`` a stddev above its mean (load.figure_verdict)."""
    if not _timed(key):
        return None
    if why := unreliable(record) or (record.ratio_caveat if _is_ratio(key) else None):
        return why
    if key in HOST_TIMER_KEYS and (why := timers_disagree(record.values)):
        return why
    return figure_verdict(record, key)


def _unreliable_note(why: str) -> str:
    if why == INTERPRETER_NOTE or why.startswith((RATIO_NOTE, TIMERS_NOTE)):
        return why[0].upper() + why[1:]
    return f"unreliable timing: {why}; the figure measures the machine's load, not the case"


def _in_column_order(keys: list[str]) -> list[str]:
    order = {k: i for i, k in enumerate(VALUE_LABELS)}
    return sorted(keys, key=lambda k: (order.get(k, len(order)), k))


# A figure in a note, or the range that merged notes give it ("3.2", "1,500", "2.9–4.1").
_FIGURE = re.compile(r"\d+(?:[.,]\d+)*(?:–\d+(?:[.,]\d+)*)?")
_MERGED = "unreliable timing: "  # the notes of one verdict whose figures vary row by row


def _note_shape(note: str) -> str:
    """What a note says, its figures aside: rows timed at load 3.21, 3.45 and 2.9 gave three footnotes
    that read alike (issue 73); one shape is one footnote. Other notes name rows or backends, whose
    digits are no measurement, and keep their own text."""
    return _FIGURE.sub("#", note) if note.startswith(_MERGED) else note


def _merged(notes: list[str]) -> str:
    """One note standing for ``notes`` (of one shape): each figure that differs becomes its range."""
    figures = [_FIGURE.findall(n) for n in notes]
    between = _FIGURE.split(notes[0])
    out = [between[0]]
    for i, text in enumerate(between[1:]):
        seen = sorted({f[i] for f in figures}, key=lambda v: float(v.replace(",", "")))
        out += [seen[0] if len(seen) == 1 else f"{seen[0]}–{seen[-1]}", text]
    return "".join(out)


def note_number(notes: list[str], note: str) -> int:
    """The ``[n]`` of ``note`` among ``footnotes(...)``: the footnote of its shape."""
    return [_note_shape(n) for n in notes].index(_note_shape(note)) + 1


def footnotes(records: list[Record]) -> list[str]:
    """The texts the cells of these rows point to, in order of first use: each reason a case did not
    run, and each reason a figure is no result, once (cell ``[n]`` is entry n - 1, ``note_number``).
    Read off the cells' own verdicts (``_verdict``), so no footnote is left that no cell points to;
    notes that differ only in their figures are one footnote giving their range."""
    notes: dict[str, list[str]] = {}
    for r in records:
        not_run = _not_run(r)
        if r.oom:
            continue
        if not_run is not None:
            notes.update({not_run[1]: [not_run[1]]} if not_run[1] else {})
            continue
        for key in _in_column_order(list(r.values)):
            if why := _verdict(r, key):
                note = _unreliable_note(why)
                notes.setdefault(_note_shape(note), []).append(note)
    return [_merged(same) for same in notes.values()]


TEXT_CELL_MAX = 120  # a C++ kernel name runs to 900 characters; a table cell shows its start


def short_text(text: str, width: int = TEXT_CELL_MAX) -> str:
    """A text cell cut to ``width`` characters (the full text stays in the JSON): one D3 cell of three
    templated kernel names made a writeup line of 1,093 characters (issue 51)."""
    return text if len(text) <= width else text[: width - 1] + "…"


def _cell(record: Record, key: str, notes: list[str], show: bool = False) -> str:
    if record.oom:
        return "OOM"
    not_run = _not_run(record)
    if not_run is not None and key not in record.texts:
        # every cell says it did not run; the reason once, as a footnote under the table
        label, reason = not_run
        return f"{label} [{note_number(notes, reason)}]" if reason else label
    if key in record.texts:
        return short_text(record.texts[key])
    if key not in record.values:
        return MISSING
    why = _verdict(record, key)
    mark = f"{verdict_label(why)} [{note_number(notes, _unreliable_note(why))}]" if why else ""
    if mark and not show:
        return mark
    text = format_number(key, record.values[key])
    std = _std_key(key, record.values)
    if std and record.values.get("rounds_n") != 1:  # one round has no spread: "± 0" would claim one
        text += f" ± {format_number(key, record.values[std])}"
    return f"{text} ({mark})" if mark else text


def _ordered_descriptors(records: list[Record]) -> list[str]:
    keys: dict[str, None] = {}
    for r in records:
        keys.update(dict.fromkeys(r.descriptors))
    order = {k: i for i, k in enumerate(PARAM_ORDER)}
    return sorted(keys, key=lambda k: (order.get(k, len(order)), k))


def _absent_backends(records: list[Record]) -> tuple[list[Record], list[str]]:
    """Implementations none of whose rows could run on a device (cuDNN or mem-efficient SDPA on a CPU)
    leave the table: a column of "unsupported" cells says less than one line under it (issue 51: 228
    such cells in D11 and D12 on a CPU). Returns the rows kept and those lines."""
    by_impl: dict[tuple[str, str], list[Record]] = {}
    for r in records:
        if "impl" in r.descriptors:
            by_impl.setdefault((r.device, str(r.descriptors["impl"])), []).append(r)
    gone = {k for k, rs in by_impl.items() if all(r.texts.get("status") == "unsupported" for r in rs)}
    kept = [r for r in records if (r.device, str(r.descriptors.get("impl"))) not in gone]
    if not gone or not kept:  # nothing else ran: the table itself says so
        return records, []
    lines = []
    for device in sorted({d for d, _ in gone}):
        impls = sorted(i for d, i in gone if d == device)
        reason = next((r.skipped or r.texts.get("reason") for r in by_impl[(device, impls[0])]), None) or ""
        said = f" (torch: {short_text(reason, 100)})" if reason else ""
        lines.append(f"Not available on {device}, so not in the table: {', '.join(impls)}{said}.")
    return kept, lines


def build_group_table(group: str, records: list[Record], show_unreliable: bool = False) -> GroupTable:
    records, absent = _absent_backends(records)
    _mark_ratio_sources(records)
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
    notes = footnotes(records)
    rows = []
    for r in records:
        row = {_header(k): format_param(k, r.descriptors.get(k)) for k in varying}
        row.update({value_label(k): _cell(r, k, notes, show_unreliable) for k in value_keys})
        rows.append(row)
    long = pd.DataFrame(rows) if rows else pd.DataFrame()
    key = records[0].group_key if records else None
    pivot = _pivot(key, records, varying, value_keys, None, show_unreliable)
    table = GroupTable(group, key, long, pivot, fixed, records, len(varying), varying, value_keys, absent)
    table.show_unreliable = show_unreliable
    return table


def _pivot(
    group_key: str | None,
    records: list[Record],
    varying: list[str],
    value_keys: list[str],
    spec: PivotSpec | None = None,
    show: bool = False,
) -> pd.DataFrame | None:
    """The handout-shaped view of a group: ``spec``, or the PIVOTS entry of its schema key."""
    spec = spec or PIVOTS.get(group_key or "")
    if spec is None:
        return None
    columns = [next((c for c in alts if c in varying), None) for alts in spec.columns]
    columns = [c for c in columns if c is not None]
    values = [v for v in spec.values if v in value_keys]
    if not columns or not values:
        return None
    index = [k for k in varying if k not in columns]
    notes = footnotes(records)
    cells: dict[tuple, dict[str, str]] = {}
    col_order: dict[str, tuple] = {}  # label -> sort key: value first, then the spread parameters
    for r in records:  # already sorted by the varying descriptors: rows come out in order
        row_key = tuple(format_param(k, r.descriptors.get(k)) for k in index)
        col_key = " / ".join(format_param(k, r.descriptors.get(k)) for k in columns)
        col_sort = tuple(_sort_key(k, r.descriptors.get(k)) for k in columns)
        row = cells.setdefault(row_key, {})
        for i, v in enumerate(values):
            label = col_key if len(values) == 1 else f"{value_label(v)}: {col_key}"
            row[label] = _cell(r, v, notes, show)
            col_order[label] = (i, col_sort)
    col_order = dict(sorted(col_order.items(), key=lambda kv: kv[1]))
    rows = []
    for row_key, row in cells.items():
        out = {_header(k): v for k, v in zip(index, row_key, strict=True)}
        out.update({c: row.get(c, MISSING) for c in col_order})
        rows.append(out)
    frame = pd.DataFrame(rows)
    what = ", ".join(value_label(v) for v in values)
    frame.attrs["title"] = f"{what} by {' / '.join(_header(c) for c in columns)}"
    return frame


def build_tables(records: list[Record], show_unreliable: bool = False) -> list[GroupTable]:
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.group, []).append(r)
    return [build_group_table(g, rs, show_unreliable) for g, rs in groups.items()]
