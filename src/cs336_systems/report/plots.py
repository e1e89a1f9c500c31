"""The writeup's figures (matplotlib, Agg): D13 all-reduce, D6/D7a attention and D11 flash sweeps.

The tables' verdict holds here too (issue 51): a point whose timing is unreliable is drawn as a red
cross and named in the legend; a Triton kernel timed under the interpreter is no point at all. A panel
"vs sequence length" with one sequence length says nothing about the trend and is left out; the x ticks
are the measured values, so every point sits on a labelled tick."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path

from cs336_systems.report.load import VALUE_LABELS, Record, is_interpreted, numeric, rows_of, unreliable
from cs336_systems.report.tables import _header, format_param
from cs336_systems.units import parse_size

Point = tuple[float, float, bool]  # x, y, and whether the row's timing is not a result
Panels = dict[str, dict[str, list[Point]]]


def _point(r: Record, x: float | None, key: str) -> Point | None:
    """The row as a point, flagged when its timing is unreliable; None when it is no figure."""
    if x is None or key not in r.values or is_interpreted(r):
        return None
    return (x, r.values[key], unreliable(r) is not None)


def _line_plot(
    path: Path,
    panels: Panels,
    xlabel: str,
    ylabel: str,
    title: str,
    x_base: int = 2,
) -> Path | None:
    """``line_figure`` saved to ``path`` (None, and no file, when there is nothing to draw)."""
    fig = line_figure(panels, xlabel, ylabel, title, x_base)
    if fig is None:
        return None
    import matplotlib.pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _drawable(panels: Panels) -> Panels:
    """Panels with at least two x values: one x value is no trend to plot against (issue 51)."""
    return {k: v for k, v in panels.items() if len({p[0] for pts in v.values() for p in pts}) > 1}


def line_figure(panels: Panels, xlabel: str, ylabel: str, title: str, x_base: int = 2):
    """One subplot per panel, one line per series, log-log axes; a series of one point is a marker;
    unreliable points are red crosses over their series."""
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
    for ax, (panel, series) in zip(axes.flat, panels.items(), strict=False):
        flagged = False
        for label, points in series.items():
            points = sorted(points)
            # One x value: points, not a "line" of one point.
            style = (
                {"marker": "o"} if len(points) > 1 else {"marker": "o", "linestyle": "none", "markersize": 8}
            )
            if points:
                ax.plot([p[0] for p in points], [p[1] for p in points], label=label, **style)
            bad = [p for p in points if p[2]]
            if bad:
                unlabelled = "_" if flagged else ""
                ax.plot([p[0] for p in bad], [p[1] for p in bad], "x", color="red", markersize=9,
                        label=f"{unlabelled}unreliable timing (see the table)")  # fmt: skip
                flagged = True
        ax.set_xscale("log", base=x_base)
        ax.set_yscale("log")
        ax.margins(0.08)  # no point on the frame
        _plain_ticks(ax, sorted({p[0] for pts in series.values() for p in pts}))
        ax.set_title(panel, fontsize=9)
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def _plain_ticks(ax, xs: Sequence[float] = ()) -> None:
    """Tick labels as plain numbers ("1.5", "20"), never "1.525×10⁰"; within one decade the minor
    ticks carry the labels (a log axis has no major tick there). Up to 12 measured x values are the x
    ticks themselves."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:.3g}")
    ax.yaxis.set_major_formatter(plain)
    low, high = ax.get_ylim()
    ax.yaxis.set_minor_formatter(plain if high / max(low, 1e-300) < 10 else NullFormatter())
    if 1 < len(xs) <= 12:
        ax.xaxis.set_major_locator(FixedLocator(list(xs)))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.xaxis.set_minor_formatter(NullFormatter())


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
    rows = [r for r in rows_of(records, "allreduce") if not r.oom and not r.skipped]
    multi = len({r.device for r in rows}) > 1
    key = "max_ms" if any("max_ms" in r.values for r in rows) else "mean_ms"
    series: dict[str, list[Point]] = {}
    for r in rows:
        if (point := _point(r, _message_bytes(r), key)) is not None:
            series.setdefault(_label(r, ("backend", "world_size"), multi), []).append(point)
    ylabel = "max over ranks (ms)" if key == "max_ms" else "mean (ms)"
    return _line_plot(out, {"all-reduce": series}, "bytes per rank", ylabel, "D13 all-reduce latency", 10)


def plot_attention(records: list[Record], out: Path) -> Path | None:
    """D6/D7a: forward and backward time vs seq, one line per implementation and head dim."""
    rows = [r for r in rows_of(records, "attention") if not r.oom and not r.skipped]
    multi = len({r.device for r in rows}) > 1
    panels: Panels = {}
    for key, title in (("fwd_ms", "forward (ms per pass)"), ("bwd_ms", "backward (ms per pass)")):
        for r in rows:
            if (point := _point(r, numeric(r.descriptors.get("seq")), key)) is not None:
                panels.setdefault(title, {}).setdefault(_label(r, ("impl", "d"), multi), []).append(point)
    return _line_plot(out, panels, "seq", "ms", "D6/D7a attention time vs sequence length")


def plot_flash(records: list[Record], out: Path) -> Path | None:
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
    return _line_plot(out, panels, "seq", VALUE_LABELS[key].replace(" ± std", ""), title)


PLOTS: tuple[tuple[str, str, Callable[[list[Record], Path], Path | None]], ...] = (
    ("D13", "allreduce.png", plot_allreduce),
    ("D6", "attention.png", plot_attention),
    ("D11", "flash.png", plot_flash),
)
