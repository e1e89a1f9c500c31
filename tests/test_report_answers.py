"""The D22 and D24 writeup answers (issues 16, 19): rendered from the accounting with and without
measured rows, and the measured best picked from synthetic rows."""

from __future__ import annotations

import pytest

from cs336_systems.accounting.checkpointing import d22a
from cs336_systems.accounting.fsdp import fsdp_saving
from cs336_systems.report import answers
from cs336_systems.report.load import Record
from cs336_systems.report.writeup import SECTIONS

H100 = "NVIDIA H100 80GB HBM3"
# Peaks (MiB) with the minimum at every:3, listed out of order so the first or last row is not it.
PEAKS = {
    "every:6": 39_000.0,
    "every:3": 31_000.0,
    "every:1": 33_000.0,
    "every:2": 32_000.0,
    "every:4": 31_500.0,
}


def _row(group_key: str, descriptors: dict, values: dict, oom: bool = False) -> Record:
    return Record(group_key, group_key, "case", "x.json", H100, "m", descriptors, values, oom=oom)


def _ckpt_rows() -> list[Record]:
    setting = {"size": "xl", "ctx": 1024, "batch": 4, "dtype": "bf16"}
    rows = [
        _row("checkpointing", {**setting, "policy": p}, {"peak_memory_mib": m, "median_ms": 500.0})
        for p, m in PEAKS.items()
    ]
    rows.append(_row("checkpointing", {**setting, "policy": "every:8"}, {}, oom=True))  # OOM: never the best
    rows.append(
        _row(
            "checkpointing", {**setting, "policy": "none"}, {"peak_memory_mib": 75_000.0, "median_ms": 400.0}
        )
    )
    rows.append(
        _row(
            "checkpointing",
            {**setting, "policy": "nested"},
            {"peak_memory_mib": 30_000.0, "median_ms": 900.0},
        )
    )
    return rows


def test_d22_names_the_measured_best_block_size() -> None:
    text = answers.d22_answer(_ckpt_rows())
    assert "every:3, 31,000 MiB" in text  # the lowest "every:k" peak; nested (lower) is not a single level
    assert "every:2 32,000 MiB, every:4 31,500 MiB" in text  # its neighbours in k
    assert "1.25× the step time" in text  # 500 / 400 ms
    assert "No measured checkpointing rows" not in text
    assert answers.best_measured_segment(_ckpt_rows())[0] == 3


def test_d22_without_rows_gives_the_accounting_and_the_command() -> None:
    text = answers.d22_answer([])
    a = d22a(48)
    assert a.sqrt_n.strategy in text and f"ceil(log2 N) + 1 = {a.log_n.stored_inputs}" in text
    assert "O(√N) memory" in text and "O(log N) memory, O(N log N) compute" in text
    assert "No measured checkpointing rows" in text and "bench/bench_memory.py" in text


def test_d22_rows_without_peaks_are_not_called_missing() -> None:
    """CPU rows carry step times but no peak memory: the answer must say so, not deny the rows."""
    rows = [
        _row("checkpointing", {"size": "tiny", "policy": p}, {"median_ms": ms})
        for p, ms in (("none", 12.0), ("every:2", 15.0))
    ]
    text = answers.d22_answer(rows)
    assert "No measured checkpointing rows" not in text
    assert "2 measured checkpointing row(s) above carry no peak memory" in text
    assert "none 12 ms" in text and "every:2 15 ms" in text


def test_h100_bytes_agrees_with_the_accounting() -> None:
    from cs336_systems import accounting

    assert answers.H100_BYTES == accounting.H100_BYTES


def test_d22_fit_recovers_block_activations() -> None:
    n, unit, c = 48, 25.0, 40.0
    peaks = {k: 30_000 + (-(-n // k) + k * c) * unit for k in (1, 2, 3, 4, 6, 8)}
    assert answers.fitted_block_activations(peaks, n, unit) == pytest.approx(c)


def _fsdp_rows(ready_share: float) -> list[Record]:
    setting = {"size": "xl", "ctx": 512, "dtype": "bf16", "world_size": 2}
    ours = {
        "allgather_ready_share": ready_share,
        "allgather_hidden_mean": 0.97,
        "allgather_hidden_min": 0.5,
        "state_vs_ddp": 0.5,
        "time_vs_fsdp2": 1.1,
        "peak_memory_mib": 40_000.0,
    }
    return [
        _row("fsdp", {**setting, "variant": "fsdp_blocks"}, ours),
        _row("fsdp", {**setting, "variant": "individual"}, {"peak_memory_mib": 55_000.0}),
    ]


@pytest.mark.parametrize("ready_share, in_time", [(1.0, True), (0.5, False)])
def test_d24_judges_the_allgather_overlap(ready_share: float, in_time: bool) -> None:
    """Judged on the readiness share of the unit forwards (``overlap.unit_readiness``), per-block row."""
    text = answers.d24_answer(_fsdp_rows(ready_share))
    assert ("each all-gather finishes before its forward needs it" in text) is in_time
    assert ("50% of the unit forwards wait on their all-gather" in text) is not in_time
    assert "per-block units (headline)" in text
    assert "15,000 MiB below DDP's" in text and "1.10× torch's fully_shard" in text


def test_d24_without_rows_gives_the_accounting_and_the_command() -> None:
    text = answers.d24_answer([])
    saving = fsdp_saving("xl", 2)
    assert f"{saving.saving_bytes / 2**20:,.1f} MiB" in text
    assert "No measured FSDP rows" in text and "bench/bench_fsdp.py" in text


def test_sections_use_the_answers() -> None:
    by_key = {s.key: s for s in SECTIONS}
    assert by_key["D22"].answer is answers.d22_answer and by_key["D24"].answer is answers.d24_answer
