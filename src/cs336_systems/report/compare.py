"""Two runs side by side: rows paired by group and benchmark name, with the ratio of their times.

A name alone does not identify a row: D2's warm-up study and its model table both hold a
``test_step[tiny]``, and pairing one with the other printed 20x where the truth was 2x (issue 51).

pytest-benchmark's own ``pytest-benchmark compare A B`` lists rows per group without pairing them;
``--group-by=name`` (or ``fullname``) pairs them there. This mode pairs rows of any two results files
the report reads and prints one Markdown table: name, time in A, time in B, B / A, and whether the
two agree within their noise: "yes" where their bands overlap (do_bench's p20–p80, else the rounds'
mean ± std; a row stating neither is a point), "run to run" where they do not but the times are within
``RUN_TO_RUN`` (a band is one process's spread, and two processes differ by more: see the constant),
else "no". The header counts every paired row once, by the first of: not run in either, out of memory,
run on one side only, a verdict (interpreted, contended), host-bound, then the noise classes, so its counts add
up to the rows (issue 73: a file compared with itself left 23 rows "1×" unclassified). A row's verdict
holds here as in the tables: an unreliable or interpreted time shows as its mark (its figure only with
``show_unreliable``, marked), and no ratio or noise verdict is derived from it. A host-bound side
(rows.contention.host_bound) timed the host's issue rate, not the case: its noise cell says
"host-bound", with the ratio of the two CUDA-graph replays (``graph_ms``: device time alone, which
the host's load does not move, so it stands even beside such a verdict) where both sides have one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from cs336_systems.report.load import STATS_MEAN, Record, _std_key, load, unreliable
from cs336_systems.report.tables import _not_run, format_number
from cs336_systems.rows.contention import INTERPRETER_NOTE, host_bound, verdict_label

# Two processes timing one device-bound case differ by more than either's p20–p80 band: D11's device-bound
# rows timed in one pytest process and as one job each had disjoint bands on some rows (one of them with
# both runs on the same card), and two GPUs of one host differed too, each time by less than this
# allowance. Within it, a difference is not a finding. Measured: docs/perf-notes.md, "sweep figures
# against one process, explained".
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


# Every paired row falls in exactly one of these (``_kind``), in this order of precedence.
KINDS = {
    "within_noise": "within noise (bands overlap: do_bench's p20–p80, else mean ± std)",
    "run_to_run": f"within {RUN_TO_RUN:.0%} (run to run)",
    "outside_noise": "outside both",
    "host_bound": "host-bound (a device time that measured the host's issue rate)",
    "contended": "timed under contention (no ratio: rerun on a quiet machine)",
    "interpreted": "interpreted (no ratio: a Triton kernel timed on a CPU)",
    "oom": "out of memory on a side",
    "one_side": "run on one side only",
    "not_run": "not run in either",
}


@dataclass
class _Counts:
    kinds: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))
    not_run: list[str] = field(default_factory=list)


def _both_timed(ra: Record, rb: Record) -> bool:
    return all(_ran(r) and not r.oom and _time_ms(r) for r in (ra, rb))


def _kind(ra: Record, rb: Record) -> str:
    """The one class of a paired row that the header counts."""
    if not (_ran(ra) or _ran(rb)):
        return "not_run"
    if ra.oom or rb.oom:
        return "oom"
    if not _both_timed(ra, rb):
        return "one_side"
    verdicts = [unreliable(r) for r in (ra, rb)]
    if INTERPRETER_NOTE in verdicts:
        return "interpreted"
    if any(verdicts):
        return "contended"
    if any(host_bound(r.values) for r in (ra, rb)):
        return "host_bound"
    if _bands_overlap(ra, rb):
        return "within_noise"
    ta, tb = _time_ms(ra), _time_ms(rb)
    return "run_to_run" if ta and tb and abs(tb / ta - 1) <= RUN_TO_RUN else "outside_noise"


def _ratio(ra: Record, rb: Record, show: bool) -> str:
    """B / A, or why there is none: a side that is no result gives its mark (the figure with ``show``)."""
    ta, tb = _time_ms(ra), _time_ms(rb)
    ok = _both_timed(ra, rb)
    ratio = f"{tb / ta:.3g}×" if ok else "—"
    verdicts = [(side, w) for side, r in (("A", ra), ("B", rb)) if (w := unreliable(r))]
    if not verdicts or not ok:
        return ratio
    shown = f"{ratio} " if show else ""
    if any(w == INTERPRETER_NOTE for _, w in verdicts):  # the note is long: once under the table
        return f"{shown}interpreted"
    # a ratio of load, not of the case: say so instead of printing it
    return f"{shown}unreliable ({'; '.join(f'{side}: {w}' for side, w in verdicts)})"


def _band(r: Record) -> tuple[float, float] | None:
    """The row's stated noise: do_bench's p20–p80, else its rounds' mean ± std (a row of one round has
    no spread: its time alone), else its time alone; None without a time."""
    lo, hi = r.values.get("do_bench_p20_ms"), r.values.get("do_bench_p80_ms")
    if lo is not None and hi is not None:
        return lo, hi
    t = _time_ms(r)
    if t is None:
        return None
    if "do_bench_ms" in r.values or r.values.get("rounds_n") == 1:  # the host rounds' std is not its spread
        return t, t
    std = r.values.get(_std_key("mean_ms" if "mean_ms" in r.values else STATS_MEAN, r.values) or "", 0.0)
    return t - std, t + std


def _bands_overlap(ra: Record, rb: Record) -> bool:
    bands = [_band(r) for r in (ra, rb)]
    if bands[0] is None or bands[1] is None:
        return False
    (lo_a, hi_a), (lo_b, hi_b) = bands
    return lo_a <= hi_b and lo_b <= hi_a


NOISE_CELLS = {"within_noise": "yes", "run_to_run": "run to run", "outside_noise": "no"}


def _noise(ra: Record, rb: Record, kind: str) -> str:
    """Whether A and B agree within their stated noise; "host-bound" when either side's time is the
    host's issue rate (whose bands measured the host), with the CUDA-graph ratio where both have one;
    "—" where the row has no result to compare (its B / A cell says why)."""
    if kind in NOISE_CELLS:
        return NOISE_CELLS[kind]
    if _both_timed(ra, rb) and any(host_bound(r.values) for r in (ra, rb)):
        ga, gb = ra.values.get("graph_ms"), rb.values.get("graph_ms")
        return f"host-bound; graph {gb / ga:.3g}×" if ga and gb else "host-bound"
    return "—"


def _head(a: str | Path, b: str | Path, paired: int, counts: _Counts) -> str:
    """The pairing and its counts, which add up to the paired rows."""
    said = [f"{n} {KINDS[kind]}" for kind, n in counts.kinds.items() if n]
    return f"A = {a}, B = {b}: {paired} paired rows" + (f": {', '.join(said)}" if said else "")


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
        kind = _kind(ra, rb)
        counts.kinds[kind] += 1
        if kind == "not_run":
            counts.not_run.append(ra.name)
            continue
        cells = [_cell(r, show_unreliable) for r in (ra, rb)]
        ratio, noise = _ratio(ra, rb, show_unreliable), _noise(ra, rb, kind)
        lines.append(f"| {ra.group} | {ra.name} | {cells[0]} | {cells[1]} | {ratio} | {noise} |")
    out = [_head(a, b, len(paired), counts), "", *lines]
    if counts.kinds["interpreted"]:
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
