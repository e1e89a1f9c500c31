"""The writeup section of the 8B per-GPU proxy (issue 37, ``bench/bench_8b_proxy.py``): the group's own
table (one row per recipe or swapped piece, with ``vs_torch`` / ``vs_ours`` measured in the same run)
and, under it, the ratio ours / torch with the figures behind it. Registered through
``writeup.SECTION_MODULES``."""

from __future__ import annotations

from typing import Any

from cs336_systems.report.load import Record, derived_from, rows_of

SECTION_KEY = "D26p"
GROUP_KEY = "proxy_8b"


def _timed(records: list[Record]) -> dict[str, Record]:
    """The timed rows by their ``row`` parameter (not OOM, not skipped, with a step time)."""
    rows = rows_of(records, GROUP_KEY)
    return {
        str(r.descriptors.get("row")): r
        for r in rows
        if not r.oom and not r.skipped and r.values.get("step_s")
    }


def proxy_answer(records: list[Record]) -> str:
    """One line: ours / torch step time, with both rows' step time, MFU and cold first step."""
    timed = _timed(records)
    ours, torch_ = timed.get("ours"), timed.get("torch")
    if ours is None or torch_ is None:
        return "ours / torch: not measured (the run has no timed `ours` and `torch` rows)."
    if why := derived_from(ours, torch_):
        return f"ours / torch: {why}."

    def figures(r: Record) -> str:
        mfu = r.values.get("mfu")
        mfu_text = f", MFU {100 * mfu:.1f}%" if mfu is not None else ""
        return f"{r.values['step_s']:.3f} s{mfu_text}, first step after {r.values.get('first_step_s', float('nan')):.1f} s"

    ratio = ours.values["step_s"] / torch_.values["step_s"]
    return (
        f"**ours / torch step time: {ratio:.3f}×** (same run; ours {figures(ours)}; torch {figures(torch_)})."
    )


def register(writeup: Any) -> None:
    writeup.register_section(
        writeup.Section(
            key=SECTION_KEY,
            title="2026: the 8B step's per-GPU compute on one GPU (8B per-GPU proxy)",
            asks="The 8B configuration with a few blocks at context 32,768 on one GPU, unsharded, compiled "
            "blocks: ours against torch's built-ins and each piece of ours swapped for torch's (step time, "
            "MFU, peak memory, time to the first step).",
            bench="bench/bench_8b_proxy.py",
            groups=(GROUP_KEY,),
            answer=proxy_answer,
        ),
        after="D26",
    )
