"""Two runs side by side: rows paired by group and benchmark name, with the ratio of their times.

A name alone does not identify a row: D2's warm-up study and its model table both hold a
``test_step[tiny]``, and pairing one with the other printed 20x where the truth was 2x (issue 51).

pytest-benchmark's own ``pytest-benchmark compare A B`` lists rows per group without pairing them;
``--group-by=name`` (or ``fullname``) pairs them there. This mode pairs rows of any two results files
the report reads and prints one Markdown table: name, time in A, time in B, B / A, and whether the
two agree within their noise: "yes" where do_bench's p20–p80 bands overlap, "run to run" where they do
not but the medians are within ``RUN_TO_RUN`` (a band is one process's spread, and two processes differ
by more: see the constant), else "no". A row's verdict
holds here as in the tables: an unreliable or interpreted time shows as its mark (its figure only with
``show_unreliable``, marked), and no ratio or noise verdict is derived from it. A host-bound side
(rows.contention.host_bound) timed the host's issue rate, not the case: its noise cell says
"host-bound", with the ratio of the two CUDA-graph replays (``graph_ms``: device time alone, which
the host's load does not move, so it stands even beside such a verdict) where both sides have one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems.report.load import STATS_MEAN, Record, load, unreliable
from cs336_systems.report.tables import _not_run, format_number
from cs336_systems.rows.contention import INTERPRETER_NOTE, host_bound, verdict_label

# Two processes timing one device-bound case differ by more than either's p20–p80 band: on 4 x H200
# (2026-11-28), D11's nine seq-16384 rows timed in one pytest process and as one job each differed by
# 0.1–1.1% (4 of 9 bands disjoint, one of them on the same card), and two H200s of one host by 0.5%
# (the suite's kernel) and 1.5% (cuDNN). Within this, a difference is not a finding.
RUN_TO_RUN = 0.02
NAMES_SHOWN = 10  # rows named in the "not run in either" line; the rest are counted


def _time_ms(r: Record) -> float | None:
    """The row's result: do_bench's median where the row has one (its host-timed rounds are a second
    timer, which may disagree with it: tables.timers_disagree), else its mean."""
    for key in ("do_bench_ms", "mean_ms", STATS_MEAN):
        if key in r.values:
            return r.values[key]
    return None


def pair_key(r: Record) -> tuple[str, str, str]:
    """What makes two rows the same case in two runs: schema group, group name and benchmark name."""
    return (r.group_key or "", r.group, r.name)


def _ran(r: Record) -> bool:
    return r.oom or (_not_run(r) is None and _time_ms(r) is not None)


def _cell(r: Record, show: bool) -> str:
    """A side's time: OOM, why it did not run, its verdict's mark, or its figure (marked with ``show``)."""
    if r.oom:
        return "OOM"
    not_run, t = _not_run(r), _time_ms(r)
    if not_run is not None or t is None:
        return not_run[0] if not_run else "—"
    why = unreliable(r)
    if why and not show:
        return verdict_label(why)
    return format_number("mean_ms", t) + (f" ({verdict_label(why)})" if why else "")


@dataclass
class _Counts:
    contended: int = 0
    interpreted: int = 0
    within_noise: int = 0
    run_to_run: int = 0
    outside_noise: int = 0
    host_bound: int = 0
    not_run: list[str] = field(default_factory=list)


def _ratio(ra: Record, rb: Record, show: bool, counts: _Counts) -> str:
    """B / A, or why there is none: a side that is no result gives its mark (the figure with ``show``)."""
    ta, tb = _time_ms(ra), _time_ms(rb)
    ok = all(_ran(r) and not r.oom for r in (ra, rb)) and ta and tb
    ratio = f"{tb / ta:.3g}×" if ok else "—"
    verdicts = [(side, w) for side, r in (("A", ra), ("B", rb)) if (w := unreliable(r))]
    if not verdicts or not ok:
        return ratio
    shown = f"{ratio} " if show else ""
    if any(w == INTERPRETER_NOTE for _, w in verdicts):  # the note is long: once under the table
        counts.interpreted += 1
        return f"{shown}interpreted"
    counts.contended += 1  # a ratio of load, not of the case: say so instead of printing it
    return f"{shown}unreliable ({'; '.join(f'{side}: {w}' for side, w in verdicts)})"


def _bands_overlap(ra: Record, rb: Record) -> bool | None:
    """Whether the two sides' do_bench p20–p80 bands overlap (None: a side states no band)."""
    bands = [(r.values.get("do_bench_p20_ms"), r.values.get("do_bench_p80_ms")) for r in (ra, rb)]
    if any(lo is None or hi is None for lo, hi in bands):
        return None
    (lo_a, hi_a), (lo_b, hi_b) = bands
    return lo_a <= hi_b and lo_b <= hi_a


def _noise(ra: Record, rb: Record, counts: _Counts) -> str:
    """Whether A and B agree within their stated noise; "host-bound" when either side's time is the
    host's issue rate (whose bands measured the host), with the CUDA-graph ratio where both have one."""
    if not all(_ran(r) and not r.oom for r in (ra, rb)):
        return "—"
    if any(host_bound(r.values) for r in (ra, rb)):
        counts.host_bound += 1
        ga, gb = ra.values.get("graph_ms"), rb.values.get("graph_ms")
        return f"host-bound; graph {gb / ga:.3g}×" if ga and gb else "host-bound"
    overlap = _bands_overlap(ra, rb)
    if overlap is None or unreliable(ra) or unreliable(rb):  # a verdict's bands measured the load
        return "—"
    if overlap:
        counts.within_noise += 1
        return "yes"
    ta, tb = _time_ms(ra), _time_ms(rb)
    if ta and tb and abs(tb / ta - 1) <= RUN_TO_RUN:
        counts.run_to_run += 1
        return "run to run"
    counts.outside_noise += 1
    return "no"


def _head(a: str | Path, b: str | Path, paired: int, counts: _Counts) -> str:
    head = f"A = {a}, B = {b}: {paired} paired rows"
    if counts.contended:
        head += f", {counts.contended} of them timed under contention (no ratio: rerun on a quiet machine)"
    if counts.interpreted:
        head += f", {counts.interpreted} of them interpreted (no ratio: a Triton kernel timed on a CPU)"
    if counts.within_noise or counts.run_to_run or counts.outside_noise or counts.host_bound:
        head += (
            f"; {counts.within_noise} within noise (p20–p80 bands overlap), {counts.run_to_run} within"
            f" {RUN_TO_RUN:.0%} (run to run), {counts.outside_noise} outside both, {counts.host_bound}"
            " host-bound (a device time that measured the host's issue rate)"
        )
    return head


def compare_runs(a: str | Path, b: str | Path, show_unreliable: bool = False) -> str:
    """Markdown table of the rows present in both runs (by group and name) that ran in at least one,
    then the rows that ran in neither (named once) and the unpaired ones (counted)."""
    _, rows_a = load([a])
    _, rows_b = load([b])
    by_key_b = {pair_key(r): r for r in rows_b}
    lines = [
        "| group | name | A (ms) | B (ms) | B / A | within noise |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    paired, counts = set(), _Counts()
    for ra in rows_a:
        rb = by_key_b.get(pair_key(ra))
        if rb is None:
            continue
        paired.add(pair_key(ra))
        if not (_ran(ra) or _ran(rb)):
            counts.not_run.append(ra.name)
            continue
        cells = [_cell(r, show_unreliable) for r in (ra, rb)]
        ratio, noise = _ratio(ra, rb, show_unreliable, counts), _noise(ra, rb, counts)
        lines.append(f"| {ra.group} | {ra.name} | {cells[0]} | {cells[1]} | {ratio} | {noise} |")
    out = [_head(a, b, len(paired), counts), "", *lines]
    if counts.interpreted:
        out += ["", f"interpreted: {INTERPRETER_NOTE}."]
    if counts.not_run:
        names = counts.not_run[:NAMES_SHOWN]
        more = f", and {len(counts.not_run) - len(names)} more" if len(counts.not_run) > len(names) else ""
        out += ["", f"not run in either: {len(counts.not_run)} rows ({', '.join(names)}{more})"]
    only_a = [r.name for r in rows_a if pair_key(r) not in paired]
    only_b = [r.name for r in rows_b if pair_key(r) not in paired]
    if only_a or only_b:
        out += ["", f"only in A: {len(only_a)} rows; only in B: {len(only_b)} rows"]
    return "\n".join(out)
