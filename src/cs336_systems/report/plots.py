"""The writeup's figures (matplotlib, Agg): D13 all-reduce, D6/D7a attention and D11 flash sweeps.

The tables' verdict holds here too (issue 51): a point whose timing is unreliable is drawn as a red
cross and named in the legend; a Triton kernel timed under the interpreter is no point at all. A panel
"vs sequence length" with one sequence length says nothing about the trend and is left out; the x ticks
are the measured values, so every point sits on a labelled tick, written as a reader writes them (1 MB,
16k). Each implementation keeps one colour in every panel and figure (``IMPL_COLOURS``); the other
parameters of a line (head dim) pick its marker. D13 is the exception: its lines differ by world size,
so a world size has a colour and marker of its own and the backend its line style (issue 73: gloo's
three world sizes were three lines of one colour). One legend per figure, beside the panels."""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from cs336_systems.report.load import VALUE_LABELS, Record, figure_verdict, is_interpreted, numeric, rows_of
from cs336_systems.report.tables import _header, format_param
from cs336_systems.units import GIB, MIB, parse_size

Point = tuple[float, float, bool]  # x, y, and whether the row's timing is not a result
Panels = dict[str, dict[str, list[Point]]]
TickFormat = Callable[[float], str]
UNRELIABLE_LABEL = "unreliable timing (see the table)"

# One colour per implementation, fixed (harness.attention.IMPLS, the adapters rows and the all-reduce
# backends; a test holds them together): matplotlib's cycle gave sdpa_efficient brown in one panel
# and red in the next, where fewer implementations ran.
IMPL_COLOURS = {
    "pytorch": "tab:blue",
    "pytorch_compiled": "tab:orange",
    "flash_triton": "tab:green",
    "sdpa_flash": "tab:red",
    "sdpa_cudnn": "tab:purple",
    "sdpa_efficient": "tab:brown",
    "adapters": "tab:gray",
    "nccl": "tab:cyan",
    "gloo": "tab:olive",
}
SPARE_COLOURS = ("tab:pink", "#393b79", "#8c6d31", "#843c39", "#7b4173", "#637939")  # other names
MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*")
WORLD_COLOURS = ("tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple", "tab:brown")
BACKEND_LINES = {"nccl": "-", "gloo": "--"}  # any other backend: dotted
Style = dict[str, str]


def colour_of(implementation: str) -> str:
    """The implementation's colour in every plot; a name outside the table gets a spare colour chosen
    by the name itself (stable across runs and panels)."""
    if implementation in IMPL_COLOURS:
        return IMPL_COLOURS[implementation]
    return SPARE_COLOURS[zlib.crc32(implementation.encode()) % len(SPARE_COLOURS)]


def _split_label(label: str) -> tuple[str, str]:
    """A series label "impl=x, d=64" -> (implementation "x", the rest "d=64")."""
    first, _, rest = label.partition(", ")
    return first.partition("=")[2] or first, rest


def series_styles(labels: Iterable[str]) -> dict[str, dict[str, str]]:
    """Colour by the label's first parameter (the implementation or backend), marker by the rest, the
    same for a label wherever it appears in one figure (markers in order of first appearance)."""
    labels = list(dict.fromkeys(labels))
    rests = list(dict.fromkeys(_split_label(label)[1] for label in labels))
    return {
        label: {
            "color": colour_of(_split_label(label)[0]),
            "marker": MARKERS[rests.index(_split_label(label)[1]) % len(MARKERS)],
        }
        for label in labels
    }


def size_tick(nbytes: float) -> str:
    """Bytes as the benches name the sizes: MB meaning MiB (units.py): 1 MB, 10 MB, 1 GB."""
    for unit, base in (("GB", GIB), ("MB", MIB), ("KB", 1024)):
        if nbytes >= base:
            return f"{nbytes / base:.3g} {unit}"
    return f"{nbytes:g} B"


def seq_tick(seq: float) -> str:
    """A sequence length, short enough for ten ticks in one panel: 512, 1k, 16k (k = 1024)."""
    return f"{seq / 1024:g}k" if seq >= 1024 and seq % 1024 == 0 else f"{seq:g}"


def plain_tick(value: float) -> str:
    return f"{value:g}"


def _point(r: Record, x: float | None, key: str) -> Point | None:
    """The row as a point, flagged when its timing is unreliable; None when it is no figure."""
    if x is None or key not in r.values or is_interpreted(r):
        return None
    return (x, r.values[key], figure_verdict(r, key) is not None)


def _save(fig: Any, path: Path) -> Path | None:
    """``fig`` saved to ``path``, the legend beside the panels included (None, and no file, without one)."""
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def _drawable(panels: Panels) -> Panels:
    """Panels with at least two x values: one x value is no trend to plot against (issue 51)."""
    return {k: v for k, v in panels.items() if len({p[0] for pts in v.values() for p in pts}) > 1}


def _draw_series(ax: Any, label: str, points: list[Point], style: Style, handles: dict) -> None:
    """One series on ``ax``: a line (a marker alone for one point), unreliable points as red crosses."""
    points = sorted(points)
    if not points:
        return
    lone = {"linestyle": "none", "markersize": 8} if len(points) == 1 else {}
    (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style, **lone)
    handles.setdefault(label, line)
    bad = [p for p in points if p[2]]
    if bad:
        xs, ys = [p[0] for p in bad], [p[1] for p in bad]
        (cross,) = ax.plot(xs, ys, "x", color="red", markersize=9, label=UNRELIABLE_LABEL)
        handles.setdefault(UNRELIABLE_LABEL, cross)


def line_figure(
    panels: Panels,
    xlabel: str,
    ylabel: str,
    title: str,
    x_base: int = 2,
    x_format: TickFormat = plain_tick,
    styles: dict[str, Style] | None = None,
):
    """One subplot per panel, one line per series, log-log axes; a series of one point is a marker;
    unreliable points are red crosses over their series; one legend for the figure, right of it.
    ``styles`` (label -> colour, marker, line style) replaces ``series_styles``; a panel title that
    the figure's title already says is left out (D13's "all-reduce" under "D13 all-reduce latency")."""
    panels = _drawable(panels)
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    cols = min(n, 3)
    rows = math.ceil(n / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    styles = styles or series_styles(label for series in panels.values() for label in series)
    handles: dict[str, Any] = {}
    for ax, (panel, series) in zip(axes.flat, panels.items(), strict=False):
        for label, points in series.items():
            _draw_series(ax, label, points, styles[label], handles)
        ax.set_xscale("log", base=x_base)
        ax.set_yscale("log")
        ax.margins(0.08)  # no point on the frame
        _plain_ticks(ax, sorted({p[0] for pts in series.values() for p in pts}), x_format)
        ax.set_title("" if panel.lower() in title.lower() else panel, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    # outside every panel: a legend inside one covered the lines it names
    fig.legend(
        list(handles.values()), list(handles), loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=8
    )
    return fig


def _plain_ticks(ax, xs: Sequence[float] = (), x_format: TickFormat = plain_tick) -> None:
    """Tick labels as plain numbers ("1.5", "20"), never "1.525×10⁰"; within one decade the minor
    ticks carry the labels (a log axis has no major tick there). Up to 12 measured x values are the x
    ticks themselves, written by ``x_format``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.3g}")  # not "1e+03"
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    span = high / max(low, 1e-300)
    if 10 <= span < 1000:  # decades alone left D13's axis one label, "10" (issue 73): 1, 2, 5 per decade
        ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_minor_formatter(plain if span < 10 else NullFormatter())
    if 1 < len(xs) <= 12:
        ax.xaxis.set_major_locator(FixedLocator(list(xs)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: x_format(v)))
    ax.xaxis.set_minor_formatter(NullFormatter())


def _label(r: Record, keys: Sequence[str], multi_device: bool) -> str:
    parts = [f"{_header(k)}={format_param(k, r.descriptors[k])}" for k in keys if k in r.descriptors]
    if multi_device:
        parts.append(r.device)
    return ", ".join(parts)


def _message_bytes(r: Record) -> float | None:
    """All-reduce size: extra_info ``bytes`` when recorded (exact), else the ``nbytes`` label parsed."""
    return r.values.get("bytes") or parse_size(r.descriptors.get("nbytes"))


def world_size_styles(rows: list[Record], labels: dict[str, Record]) -> dict[str, Style]:
    """D13's lines: a colour and a marker per world size (in order of size), a line style per backend."""
    sizes = sorted({numeric(r.descriptors.get("world_size")) or 0 for r in rows})
    styles = {}
    for label, r in labels.items():
        i = sizes.index(numeric(r.descriptors.get("world_size")) or 0)
        line = BACKEND_LINES.get(str(r.descriptors.get("backend")), ":")
        styles[label] = {"color": WORLD_COLOURS[i % len(WORLD_COLOURS)], "marker": MARKERS[i % len(MARKERS)]}
        styles[label]["linestyle"] = line
    return styles


def allreduce_figure(records: list[Record]):
    """D13: latency vs size, one line per backend and world size (max over ranks where recorded)."""
    rows = [r for r in rows_of(records, "allreduce") if not r.oom and not r.skipped]
    devices = sorted({r.device for r in rows})
    key = "max_ms" if any("max_ms" in r.values for r in rows) else "mean_ms"
    series: dict[str, list[Point]] = {}
    labels: dict[str, Record] = {}
    for r in rows:
        if (point := _point(r, _message_bytes(r), key)) is not None:
            label = _label(r, ("backend", "world_size"), len(devices) > 1)
            series.setdefault(label, []).append(point)
            labels.setdefault(label, r)
    ylabel = "max over ranks (ms)" if key == "max_ms" else "mean (ms)"
    xlabel = "bytes per rank (MB = 2²⁰ bytes)"
    panel = devices[0] if len(devices) == 1 else "one line per backend, world size and device"
    styles = world_size_styles(rows, labels)
    return line_figure({panel: series}, xlabel, ylabel, "D13 all-reduce latency", 10, size_tick, styles)


def attention_figure(records: list[Record]):
    """D6/D7a: forward and backward time vs seq, one line per implementation and head dim."""
    rows = [r for r in rows_of(records, "attention") if not r.oom and not r.skipped]
    multi = len({r.device for r in rows}) > 1
    panels: Panels = {}
    for key, title in (("fwd_ms", "forward (ms per pass)"), ("bwd_ms", "backward (ms per pass)")):
        for r in rows:
            if (point := _point(r, numeric(r.descriptors.get("seq")), key)) is not None:
                panels.setdefault(title, {}).setdefault(_label(r, ("impl", "d"), multi), []).append(point)
    return line_figure(
        panels, "seq (k = 1024)", "ms", "D6/D7a attention time vs sequence length", 2, seq_tick
    )


def flash_figure(records: list[Record]):
    """D11: do_bench time vs seq, one panel per dtype and head dim, one line per implementation; the
    fwd_bwd pass when the sweep has passes."""
    rows = [r for r in rows_of(records, "flash_sweep") if not r.oom and not r.skipped]
    pass_key = next((k for k in ("pass_", "mode") if any(k in r.descriptors for r in rows)), None)
    if pass_key and any(r.descriptors.get(pass_key) == "fwd_bwd" for r in rows):
        rows = [r for r in rows if r.descriptors.get(pass_key) == "fwd_bwd"]
    multi = len({r.device for r in rows}) > 1
    key = "do_bench_ms" if any("do_bench_ms" in r.values for r in rows) else "mean_ms"
    panels: Panels = {}
    for r in sorted(
        rows, key=lambda r: (str(r.descriptors.get("dtype")), numeric(r.descriptors.get("d")) or 0)
    ):
        if (point := _point(r, numeric(r.descriptors.get("seq")), key)) is not None:
            panel = _label(r, ("dtype", "d"), False) or "all"
            panels.setdefault(panel, {}).setdefault(_label(r, ("impl",), multi), []).append(point)
    title = "D11 FlashAttention sweep" + (" (fwd+bwd)" if pass_key else "")
    ylabel = VALUE_LABELS[key].replace(" ± std", "")
    return line_figure(panels, "seq (k = 1024)", ylabel, title, 2, seq_tick)


def plot_allreduce(records: list[Record], out: Path) -> Path | None:
    return _save(allreduce_figure(records), out)


def plot_attention(records: list[Record], out: Path) -> Path | None:
    return _save(attention_figure(records), out)


def plot_flash(records: list[Record], out: Path) -> Path | None:
    return _save(flash_figure(records), out)


PLOTS: tuple[tuple[str, str, Callable[[list[Record], Path], Path | None]], ...] = (
    ("D13", "allreduce.png", plot_allreduce),
    ("D6", "attention.png", plot_attention),
    ("D11", "flash.png", plot_flash),
)
