"""The writeup's figures read on their data, not their pixels: tick labels as a reader writes them
(1 MB meaning MiB, 16k), no two tick labels over each other, one legend beside the panels, and one
colour per implementation in every panel and figure."""

from __future__ import annotations

from itertools import pairwise

import pytest

from cs336_systems import report
from cs336_systems.report import plots
from cs336_systems.units import GIB, MIB

GPU = "NVIDIA H200"
QUIET = {"rounds_spread": 0.01, "rounds_n": 10.0}
SEQS = [2**k for k in range(7, 17)]  # 128 .. 65536, the D11 sweep


def _rec(key: str, desc: dict, values: dict, device: str = GPU) -> report.Record:
    name = f"{key}[{'-'.join(map(str, desc.values()))}]"
    return report.Record(f"{key} group", key, name, "s", device, "m", desc, {**values, **QUIET})


def _drawn(fig) -> None:
    fig.canvas.draw()


def _tick_texts(ax) -> list[str]:
    return [t.get_text() for t in ax.get_xticklabels() if t.get_text()]


def test_tick_labels_name_sizes_and_lengths() -> None:
    assert [plots.size_tick(n) for n in (MIB, 10 * MIB, 100 * MIB, GIB, 512)] == [
        "1 MB",
        "10 MB",
        "100 MB",
        "1 GB",
        "512 B",
    ]
    assert [plots.seq_tick(s) for s in (128, 1000, 1024, 8192, 16384, 65536)] == [
        "128",
        "1000",
        "1k",
        "8k",
        "16k",
        "64k",
    ]


def test_allreduce_ticks_are_sizes_and_the_legend_covers_no_panel() -> None:
    rows = [
        _rec("allreduce", {"backend": b, "world_size": w, "nbytes": f"{n}MB"}, {"max_ms": 0.1 * n * w})
        for b in ("nccl", "gloo")
        for w in (2, 4)
        for n in (1, 10, 100, 1024)
    ]
    fig = plots.allreduce_figure(rows)
    _drawn(fig)
    (ax,) = fig.axes
    assert _tick_texts(ax) == ["1 MB", "10 MB", "100 MB", "1 GB"]
    assert "MB = 2²⁰ bytes" in ax.get_xlabel()
    assert ax.get_legend() is None and len(fig.legends) == 1
    legend = fig.legends[0].get_window_extent()
    assert not legend.overlaps(ax.get_window_extent())  # beside the lines, not over them
    colours = {line.get_label(): line.get_color() for line in ax.lines}
    # a world size is a colour (issue 73: gloo's three world sizes were one colour); a backend a line style
    assert colours["backend=nccl, world_size=2"] != colours["backend=nccl, world_size=4"]
    assert colours["backend=nccl, world_size=2"] == colours["backend=gloo, world_size=2"]
    styles = {line.get_label(): line.get_linestyle() for line in ax.lines}
    assert styles["backend=nccl, world_size=2"] != styles["backend=gloo, world_size=2"]


def _visible_y_labels(ax) -> list[str]:
    low, high = ax.get_ylim()
    ticks = [*ax.yaxis.get_ticklabels(which="major"), *ax.yaxis.get_ticklabels(which="minor")]
    return [t.get_text() for t in ticks if t.get_text() and low <= t.get_position()[1] <= high]


def test_allreduce_gives_each_world_size_a_colour_readable_ticks_and_one_title() -> None:
    """Issue 73's figure: gloo at 2, 4 and 6 ranks, 1 and 10 MB, 4–60 ms on a busy CPU: three lines of
    one colour, a log axis labelled only "10", and a panel title repeating the figure's."""
    cpu = "cpu (x86_64, 2 cores)"
    rows = [
        _rec(
            "allreduce",
            {"backend": "gloo", "world_size": w, "nbytes": f"{n}MB"},
            {"max_ms": 2.0 * w + 0.83 * n * w},
            cpu,
        )
        for w in (2, 4, 6)
        for n in (1, 10)
    ]
    fig = plots.allreduce_figure(rows)
    _drawn(fig)
    (ax,) = fig.axes
    lines = [line for line in ax.lines if line.get_label().startswith("backend=")]
    assert len(lines) == 3
    assert len({line.get_color() for line in lines}) == 3 and len({line.get_marker() for line in lines}) == 3
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    assert [f"backend=gloo, world_size={w}" for w in (2, 4, 6)] == legend
    assert _tick_texts(ax) == ["1 MB", "10 MB"]
    y_labels = _visible_y_labels(ax)
    assert len(y_labels) >= 3 and {"5", "10", "20", "50"} <= set(y_labels), y_labels
    title = fig.get_suptitle()
    assert ax.get_title() == cpu and ax.get_title().lower() not in title.lower()


def _flash_rows() -> list[report.Record]:
    """The D11 sweep: bf16 runs six implementations, fp32 four (no sdpa_flash or cuDNN there), which
    moved sdpa_efficient from brown to red under matplotlib's colour cycle."""
    impls = {"bf16": plots.IMPL_COLOURS.keys() - {"adapters", "nccl", "gloo"}}
    impls["fp32"] = impls["bf16"] - {"sdpa_flash", "sdpa_cudnn"}
    return [
        _rec("flash_sweep", {"impl": i, "dtype": dt, "d": 64, "seq": s}, {"do_bench_ms": s / 1e3})
        for dt, names in impls.items()
        for i in sorted(names)
        for s in SEQS
    ]


def test_flash_keeps_one_colour_per_implementation_and_readable_ticks() -> None:
    fig = plots.flash_figure(_flash_rows())
    _drawn(fig)
    bf16, fp32 = fig.axes[:2]
    for ax in (bf16, fp32):
        assert _tick_texts(ax) == ["128", "256", "512", "1k", "2k", "4k", "8k", "16k", "32k", "64k"]
        boxes = [t.get_window_extent() for t in ax.get_xticklabels() if t.get_text()]
        assert all(a.x1 < b.x0 for a, b in pairwise(boxes)), "tick labels overlap"
        for line in ax.lines:
            impl = line.get_label().removeprefix("impl=")
            assert line.get_color() == plots.IMPL_COLOURS[impl], impl
    assert "impl=sdpa_efficient" in [line.get_label() for line in fp32.lines]
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert len(labels) == len(set(labels)) == 6  # one legend entry per implementation, not per panel


def test_colour_map_covers_every_implementation_and_is_stable() -> None:
    attention = pytest.importorskip("cs336_systems.harness.attention")
    from cs336_systems.harness.adapters import IMPL

    for impl in (*attention.IMPLS, IMPL, "nccl", "gloo"):
        assert impl in plots.IMPL_COLOURS, impl
    assert len(set(plots.IMPL_COLOURS.values())) == len(plots.IMPL_COLOURS)
    other = plots.colour_of("someone_elses_kernel")
    assert other == plots.colour_of("someone_elses_kernel") and other not in plots.IMPL_COLOURS.values()
    styles = plots.series_styles(["impl=pytorch, d=16", "impl=pytorch, d=32", "impl=flash_triton, d=16"])
    assert styles["impl=pytorch, d=16"]["color"] == styles["impl=pytorch, d=32"]["color"]
    assert styles["impl=pytorch, d=16"]["marker"] == styles["impl=flash_triton, d=16"]["marker"]
    assert styles["impl=pytorch, d=16"]["marker"] != styles["impl=pytorch, d=32"]["marker"]


def test_unreliable_points_are_named_once_in_the_figure_legend() -> None:
    series = {"impl=a": [(128.0, 1.5, False), (256.0, 1.6, True)], "impl=b": [(128.0, 1.7, True)]}
    fig = plots.line_figure({"p": series, "q": series}, "seq", "ms", "t")
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels.count(plots.UNRELIABLE_LABEL) == 1 and labels.count("impl=a") == 1
    ax = fig.axes[0]  # a y axis reaching 1,000 says so, not "1e+03"
    ax.set_ylim(100, 2000)
    plots._plain_ticks(ax)
    fig.canvas.draw()
    assert not any("e+" in t.get_text() for t in ax.get_yticklabels())
