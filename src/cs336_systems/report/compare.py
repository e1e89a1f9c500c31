"""Two runs side by side: rows paired by group and benchmark name, with the ratio of their times.

A name alone does not identify a row: D2's warm-up study and its model table both hold a
``test_step[tiny]``, and pairing one with the other printed 20x where the truth was 2x (issue 51).

pytest-benchmark's own ``pytest-benchmark compare A B`` lists rows per group without pairing them;
``--group-by=name`` (or ``fullname``) pairs them there. This mode pairs rows of any two results files
the report reads and prints one Markdown table: name, time in A, time in B, B / A.
"""

from __future__ import annotations

from pathlib import Path

from cs336_systems.report.load import STATS_MEAN, Record, load, unreliable
from cs336_systems.report.tables import format_number


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


def compare_runs(a: str | Path, b: str | Path, show_unreliable: bool = False) -> str:
    """Markdown table of the rows present in both runs (by group and name), then the unpaired ones."""
    _, rows_a = load([a])
    _, rows_b = load([b])
    by_key_b = {pair_key(r): r for r in rows_b}
    lines = ["| group | name | A (ms) | B (ms) | B / A |", "| --- | --- | --- | --- | --- |"]
    paired = set()
    unreliable_rows = 0
    for ra in rows_a:
        key = pair_key(ra)
        rb = by_key_b.get(key)
        if rb is None:
            continue
        paired.add(key)
        ta, tb = _time_ms(ra), _time_ms(rb)
        cells = [
            "OOM" if r.oom else format_number("mean_ms", t) if t is not None else "—"
            for r, t in ((ra, ta), (rb, tb))
        ]
        ratio = f"{tb / ta:.3g}×" if ta and tb and not (ra.oom or rb.oom) else "—"
        why = [f"{side}: {w}" for side, r in (("A", ra), ("B", rb)) if (w := unreliable(r))]
        if why and ratio != "—":  # a ratio of load, not of the case: say so instead of printing it
            shown = f"{ratio} " if show_unreliable else ""
            ratio = f"{shown}unreliable ({'; '.join(why)})"
            unreliable_rows += 1
        lines.append(f"| {ra.group} | {ra.name} | {cells[0]} | {cells[1]} | {ratio} |")
    only_a = [r.name for r in rows_a if pair_key(r) not in paired]
    only_b = [r.name for r in rows_b if pair_key(r) not in paired]
    head = f"A = {a}, B = {b}: {len(paired)} paired rows"
    if unreliable_rows:
        head += f", {unreliable_rows} of them timed under contention (no ratio: rerun on a quiet machine)"
    out = [head, "", *lines]
    if only_a or only_b:
        out += ["", f"only in A: {len(only_a)} rows; only in B: {len(only_b)} rows"]
    return "\n".join(out)
