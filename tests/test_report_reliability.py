"""The reliability rule (docs/timing-verdicts.md: one verdict per row) held by every figure the report derives: a row of
one round on a loaded host, shares of a step's time, ``--compare``'s cells and counts, and D25's
hardware figures. Synthetic rows only: no bench runs here."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from cs336_systems import report
from cs336_systems.report import tables
from cs336_systems.report.compare import compare_runs
from cs336_systems.report.load import unreliable
from cs336_systems.rows import contention

CPU = "cpu (x86_64, 2 cores)"
GPU = "NVIDIA H200"
LOADED = {"load_avg_1m": 6.33, "cpu_cores": 2.0}
QUIET = {"load_avg_1m": 0.2, "cpu_cores": 2.0, "rounds_spread": 0.01, "rounds_n": 10.0}
TIGHT_LOADED = {**LOADED, "rounds_spread": 0.01, "rounds_n": 10.0}  # rounds agree: a result


def _bench(name: str, key: str, params: dict, extra: dict, device: str | None = CPU) -> dict:
    extra = {"group_key": key, **({"device_name": device} if device else {}), **extra}
    return {"group": f"{key} group", "name": name, "params": params, "extra_info": extra, "stats": {}}


def _write(path: Path, benchmarks: list[dict]) -> Path:
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": "now", "version": "5"}))
    return path


def _cells(table: report.GroupTable) -> str:
    return " ".join(table.long.astype(str).to_numpy().ravel())


# ---- a row of one round on a loaded host ------------------------------------------------------------


def _grading_row(load: float) -> dict:
    """bench_grading's row: one round, host wall-clock, no device_name (record_times' facts)."""
    facts = {"load_avg_1m": load, "cpu_cores": 2.0, "rounds_n": 1.0, "mean_ms": 20087.0, "std_ms": 0.0}
    return _bench("test_grade_one_repository[course]", "grading", {"case": "course"}, facts, device=None)


def test_one_round_on_a_loaded_host_is_no_result_even_without_a_device(tmp_path: Path) -> None:
    busy, calm = _grading_row(6.33), _grading_row(0.5)
    assert not contention.rounds_agree(busy["extra_info"])  # one round has no spread to agree
    _, records = report.load([_write(tmp_path / "r.json", [busy])])
    assert unreliable(records[0]) == "load average 6.33 on 2 cores"
    assert contention.row_verdict(busy["extra_info"]) == "load average 6.33 on 2 cores"  # the terminal's
    (table,) = report.build_tables(records)
    assert "20,087" not in _cells(table) and "unreliable [1]" in _cells(table)
    _, records = report.load([_write(tmp_path / "q.json", [calm])])
    (table,) = report.build_tables(records)
    assert "20,087" in _cells(table) and "± 0" not in _cells(table)  # one round: no spread to print
    # a GPU row still ignores the host's load
    gpu = _bench("t", "grading", {"case": "x"}, {**LOADED, "rounds_n": 1.0, "mean_ms": 1.0}, GPU)
    assert contention.row_verdict(gpu["extra_info"]) is None


def test_shares_of_an_unreliable_step_are_not_printed(tmp_path: Path) -> None:
    loose = {**LOADED, "rounds_spread": 0.18, "rounds_n": 10.0}
    step = {"mean_ms": 80.0, "comm_ms": 20.0, "comm_share": 0.25, "overlap_share": 0.5}
    rows = [
        _bench("test_ddp[flat]", "ddp", {"variant": "flat"}, {**step, **loose}),
        _bench("test_ddp[bucketed]", "ddp", {"variant": "bucketed"}, {**step, **loose}),
        _bench(
            "test_sharding[ours]", "sharding", {"impl": "ours"}, {**step, **loose, "optim_state_share": 0.5}
        ),
    ]
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    for table in report.build_tables(records):
        cells = _cells(table)
        assert "25.0%" not in cells and "unreliable [1]" in cells, cells
        assert "comm share" in table.long.columns
    (sharding,) = [t for t in report.build_tables(records) if t.group_key == "sharding"]
    assert sharding.long["optim state share"].item() == "50.0%"  # memory, not time: it stands
    shown = report.build_tables(records, show_unreliable=True)
    assert "25.0% (unreliable [1])" in _cells(shown[0])
    _, quiet = report.load([_write(tmp_path / "q.json", [_bench("t", "ddp", {}, {**step, **QUIET})])])
    assert "25.0%" in _cells(report.build_tables(quiet)[0])


# ---- a host-bound GPU row -----------------------------------------------------------------------------


def test_host_bound_is_launch_at_least_do_bench() -> None:
    assert contention.host_bound({"launch_ms": 0.05, "do_bench_ms": 0.02})
    assert contention.host_bound({"launch_ms": 0.02, "do_bench_ms": 0.02})  # the device idles as often
    assert not contention.host_bound({"launch_ms": 0.01, "do_bench_ms": 0.02})
    assert not contention.host_bound({"do_bench_ms": 0.02})  # rows written before launch_ms
    assert not contention.host_bound({"launch_ms": 0.05})
    assert not contention.host_bound({"launch_ms": 0.05, "do_bench_ms": 0.0})


def test_a_host_bound_gpu_row_is_judged_by_the_load_like_a_cpu_row(tmp_path: Path) -> None:
    """A GPU row's device time is the host's issue rate when the host issues slower than the device
    runs: the host's load moves it as it moves a CPU row's."""
    busy = {"load_avg_1m": 100.0, "cpu_cores": 32.0, "rounds_spread": 0.18, "rounds_n": 10.0}
    device_bound = {"device_name": GPU, "do_bench_ms": 0.5, "launch_ms": 0.05, **busy}
    issue_bound = {**device_bound, "do_bench_ms": 0.03}
    assert contention.row_verdict(device_bound) is None
    assert contention.row_verdict(issue_bound) == "load average 100 on 32 cores, host-bound"
    # the report's verdict is the same one
    rows = [
        _bench(f"t[{i}]", "flash_sweep", {}, extra, GPU)
        for i, extra in enumerate((device_bound, issue_bound))
    ]
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    assert [unreliable(r) for r in records] == [None, "load average 100 on 32 cores, host-bound"]


# ---- --compare ---------------------------------------------------------------------------------------


def _compare_runs(tmp_path: Path, b_extra: dict) -> tuple[Path, Path]:
    a = [
        _bench("test_flash[triton]", "flash_sweep", {"impl": "flash_triton"}, {"mean_ms": 900.0, **QUIET}),
        _bench("test_model[tiny]", "model", {"size": "tiny"}, {"mean_ms": 10.5, **QUIET}),
        _bench("test_fused[cuda]", "fused_loss", {"impl": "x"}, {"status": "skipped", "skipped": "no GPU"}),
    ]
    b = [
        a[0],
        _bench("test_model[tiny]", "model", {"size": "tiny"}, {"mean_ms": 31.5, **b_extra}),
        a[2],
    ]
    return _write(tmp_path / "a.json", a), _write(tmp_path / "b.json", b)


def test_compare_names_interpreted_rows_and_hides_unreliable_figures(tmp_path: Path) -> None:
    a, b = _compare_runs(tmp_path, {**LOADED, "rounds_spread": 0.18, "rounds_n": 10.0})
    text = compare_runs(a, b)
    rows = {
        line.split(" | ")[1]: line for line in text.splitlines() if line.startswith("| ") and " | " in line
    }
    # the last column, within noise, is "—": a verdict's band is the load's (B / A says which verdict)
    assert rows["test_flash[triton]"].endswith("| interpreted | interpreted | interpreted | — |"), rows
    assert "900" not in text and "31.50" not in text and "3×" not in text
    assert rows["test_model[tiny]"].endswith(
        "| 10.50 | unreliable | unreliable (B: load average 6.33 on 2 cores) | — |"
    )
    head = "3 paired rows: 1 timed under contention (no ratio: rerun on a quiet machine), 1 interpreted"
    assert head in text and "a CPU), 1 not run in either" in text
    assert "not run in either: 1 rows (test_fused[cuda])" in text and "test_fused[cuda] |" not in text
    shown = compare_runs(a, b, show_unreliable=True)
    assert "| 10.50 | 31.50 (unreliable) | 3× unreliable (B: load average 6.33 on 2 cores) |" in shown
    assert "900 (interpreted)" in shown
    a, b = _compare_runs(tmp_path, TIGHT_LOADED)  # rounds that agree are a result at any load
    assert "| 10.50 | 31.50 | 3× |" in compare_runs(a, b)


def _sweep(name: str, ms: float, band: tuple[float, float], **more: float) -> dict:
    """A D11 CUDA row: do_bench's median and its p20–p80 band, on a quiet host."""
    extra = {"do_bench_ms": ms, "do_bench_p20_ms": band[0], "do_bench_p80_ms": band[1], **QUIET, **more}
    return _bench(f"test_flash_sweep[{name}]", "flash_sweep", {"impl": name}, extra, GPU)


def test_compare_says_whether_two_runs_agree_within_their_noise(tmp_path: Path) -> None:
    a = [
        _sweep("close", 1.0, (0.9, 1.1)),
        _sweep("apart", 1.0, (0.9, 1.1)),
        _sweep("graphed", 0.03, (0.02, 0.04), launch_ms=0.05, graph_ms=0.010),
        _sweep("issue", 0.5, (0.4, 0.6), launch_ms=0.05),
        _bench("test_model[tiny]", "model", {"size": "tiny"}, {"mean_ms": 10.5, **QUIET}),
        _sweep("spread", 1.0, (0.9, 1.1)),
        _sweep("near", 1.0, (0.999, 1.001)),
    ]
    b = [
        _sweep("close", 1.05, (1.0, 1.2)),  # bands overlap
        _sweep("apart", 1.5, (1.4, 1.6)),  # they do not
        _sweep("graphed", 0.06, (0.05, 0.07), launch_ms=0.08, graph_ms=0.0102),  # host-bound both sides
        _sweep("issue", 0.04, (0.03, 0.05), launch_ms=0.05),  # host-bound in B only, no graph
        a[4],  # no band but its own time: the same time is within it
        _sweep("spread", 1.0, (0.9, 1.1), rounds_spread=0.4),  # bands overlap, but the rounds are no result
        _sweep("near", 1.015, (1.014, 1.016)),  # tight bands apart, 1.5%: two processes differ by this much
    ]
    text = compare_runs(_write(tmp_path / "a.json", a), _write(tmp_path / "b.json", b))
    cells = [line.split(" | ") for line in text.splitlines() if line.startswith("| ")][2:]  # past the header
    noise = {row[1]: row[-1] for row in cells}
    assert noise == {
        "test_flash_sweep[close]": "yes |",
        "test_flash_sweep[apart]": "no |",
        "test_flash_sweep[graphed]": "host-bound; graph 1.02× |",
        "test_flash_sweep[issue]": "host-bound |",
        "test_model[tiny]": "yes |",
        "test_flash_sweep[spread]": "— |",
        "test_flash_sweep[near]": "run to run |",
    }, text
    assert "| B / A | within noise |" in text
    assert (
        "7 paired rows: 2 within noise (bands overlap: do_bench's p20–p80, else mean ± std), 1 within 2%"
        " (run to run), 1 outside both, 2 host-bound (a device time that measured the host's issue rate), 1"
        " timed under contention" in text
    )


# ---- D25: C and W of one machine ----------------------------------------------------------------------


def _matmul(device: str, tflops: float) -> report.Record:
    values = {"mean_ms": 3.0, "matmul_tflops": tflops, **QUIET}
    return report.Record("model group", "model", "m", "s", device, "m", {"dtype": "bf16"}, values)


def _gloo(device: str, busbw: float, facts: dict) -> report.Record:
    desc = {"backend": "gloo", "world_size": 2}
    values = {"mean_ms": 5.0, "busbw_gbps": busbw, "bytes": 2.0**20, **facts}
    return report.Record("allreduce group", "allreduce", "g", "s", device, "m", desc, values)


def test_d25_never_mixes_machines_for_c_and_w() -> None:
    from cs336_systems.report import parallelism as R

    # the issue's run: an H200's matmul rate beside a CPU's gloo busbw whose rounds agree at load 11.8
    gloo = _gloo(CPU, 0.291, {**TIGHT_LOADED, "load_avg_1m": 11.8})
    assert unreliable(gloo) is None  # a result: the verdict lets it stand, the pairing must not
    mixed = [_matmul(GPU, 787.5), gloo]
    hw = R.hardware(mixed)
    assert (hw.c, hw.w) == (R.DEFAULT_C, R.DEFAULT_W)
    assert f"C was measured on {GPU} and W on {CPU}" in hw.c_source
    assert "SPEC.md" in hw.w_source and "docs/perf-notes.md" in hw.c_source  # the stated constants' sources
    text = R.parallelism_answer(mixed)
    assert "largest N_DP | `1 + ⌊B·W/C⌋` | 1 |" not in text and "0.291" not in text
    with pytest.raises(ValueError, match="figures of different machines"):
        R.measured_pair(R.measured_c(mixed)[GPU], R.measured_w(mixed)[CPU])
    # one machine that measured both: its own figures, the GPU's before the CPU's
    nvlink = _gloo(GPU, 300.0, QUIET)
    hw = R.hardware([*mixed, nvlink, _matmul(CPU, 0.5)])
    assert (hw.c, hw.w) == (787.5e12, 300.0e9) and GPU in hw.c_source and GPU in hw.w_source
    hw = R.hardware([_matmul(CPU, 0.5), gloo])
    assert (hw.c, hw.w) == (0.5e12, 0.291e9)  # a CPU's answer from a CPU's figures
    hw = R.hardware([_matmul(GPU, 787.5)])
    assert (hw.c, hw.w) == (R.DEFAULT_C, R.DEFAULT_W) and "no W: no D13 rows" in hw.c_source


# ---- a stddev above its mean (issue 73) ----------------------------------------------------------------

# The issue's D11 row: 20 host-timed rounds, their median absolute deviation 5% of the median (rounds
# that agree, a result at any load), one far-off round making the shown mean ± std "0.798 ± 2.791".
SCATTERED_ROUNDS = {
    **LOADED,
    "rounds_spread": 0.05,
    "rounds_n": 20.0,
    "mean_ms": 0.798,
    "std_ms": 2.791,
    "median_ms": 0.237,
    "do_bench_ms": 0.4,
}


def test_a_mean_its_stddev_dwarfs_is_no_result(tmp_path: Path) -> None:
    assert contention.rounds_agree(SCATTERED_ROUNDS)  # what let it through before
    cpu = _bench("test_flash_sweep[pytorch-bwd]", "flash_sweep", {"impl": "pytorch"}, SCATTERED_ROUNDS)
    assert "stddev 3.5× their mean" in (contention.row_verdict(cpu["extra_info"]) or "")
    # on a GPU, do_bench's device time is the result: it stands, the host-timed mean ± std does not
    gpu = _bench("test_flash_sweep[gpu-bwd]", "flash_sweep", {"impl": "gpu"}, SCATTERED_ROUNDS, GPU)
    assert contention.row_verdict(gpu["extra_info"]) is None
    _, records = report.load([_write(tmp_path / "r.json", [cpu, gpu])])
    assert "stddev 3.5× their mean" in (unreliable(records[0]) or "") and unreliable(records[1]) is None
    (table,) = report.build_tables(records)
    cells = dict(zip(table.long["impl"], table.long["mean ± std (ms)"], strict=True))
    assert cells == {"gpu": "unreliable [1]", "pytorch": "unreliable [1]"}, cells  # one reason, one note
    do_bench = dict(zip(table.long["impl"], table.long["do_bench median (ms)"], strict=True))
    assert do_bench == {"gpu": "0.4", "pytorch": "unreliable [1]"}
    assert len(table.footnotes) == 1 and "stddev 3.5× their mean" in table.footnotes[0]
    assert "0.798 ± 2.791" not in _cells(table)
    shown = report.build_tables(records, show_unreliable=True)[0]
    assert "0.798 ± 2.791 (unreliable [1])" in _cells(shown)


def test_a_cold_start_measured_on_purpose_keeps_its_spread(tmp_path: Path) -> None:
    """D2's warm-up study: no warm-up, the first round the slowest; the spread is what it measures."""
    cold = {"mean_ms": 812.0, "std_ms": 1500.0, "first_ms": 5000.0, "max_ms": 5000.0, **QUIET}
    rows = [
        _bench(f"test_warmup[{w}]", "warmup", {"warmup": w}, cold)
        for w in (0, 5)  # with 5 warm-ups the slow round was a disturbance, not the cold start
    ]
    assert contention.row_verdict({**cold, "warmup": 0}) is None
    assert contention.row_verdict({**cold, "warmup": 5}) is not None
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    assert [unreliable(r) is None for r in records] == [True, False]
    (table,) = report.build_tables(records)
    assert "812 ± 1,500" in _cells(table) and "unreliable [1]" in _cells(table)


def test_one_reason_is_one_footnote_whatever_its_figures(tmp_path: Path) -> None:
    """Issue 73: rows timed at load 3.21, 3.45 and 3.1 gave footnotes [1]-[3] that read alike."""
    loose = {"cpu_cores": 2.0, "rounds_spread": 0.18, "rounds_n": 10.0, "mean_ms": 5.0, "std_ms": 0.5}
    loads = {"a": 3.21, "b": 3.45, "c": 3.1}
    rows = [
        _bench(f"test_model[{n}]", "model", {"size": n}, {**loose, "load_avg_1m": load})
        for n, load in loads.items()
    ]
    spread = {**QUIET, "mean_ms": 5.0, "std_ms": 0.5}
    rows += [
        _bench(f"test_model[{n}]", "model", {"size": n}, {**spread, "rounds_spread": s})
        for n, s in (("d", 0.3), ("e", 0.95))
    ]
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    (table,) = report.build_tables(records)
    assert table.footnotes == [
        "unreliable timing: load average 3.1–3.45 on 2 cores; the figure measures the machine's load, not the case",
        "unreliable timing: rounds spread ±30–95%; the figure measures the machine's load, not the case",
    ]
    cells = dict(zip(table.long["size"], table.long["mean ± std (ms)"], strict=True))
    assert cells == {"a": "unreliable [1]", "b": "unreliable [1]", "c": "unreliable [1]"} | {
        "d": "unreliable [2]",
        "e": "unreliable [2]",
    }
    # notes naming rows keep their text: a ratio's source is a row, its digits no measurement
    assert tables._note_shape("ratio not derived: t[d16]'s timing") != tables._note_shape(
        "ratio not derived: t[d32]'s timing"
    )


# ---- a run on a busy machine: said once, not cell by cell (issue 73) -----------------------------------


def _busy_run(tmp_path: Path, load: float) -> str:
    """A tiny-model table of six rows at ``load`` (rounds between TIGHT and SPREAD: the load decides)
    and one quiet all-reduce row, through ``write_report``; the writeup's text."""
    facts = {"load_avg_1m": load, "cpu_cores": 2.0, "rounds_spread": 0.18, "rounds_n": 10.0}
    rows = [
        _bench(
            f"test_model[tiny-{dtype}-{mode}]",
            "model",
            {"size": "tiny", "dtype": dtype, "mode": mode},
            {"mean_ms": 12.5, "std_ms": 1.0, "model_flops": 2e8, **facts},
        )
        for dtype in ("fp32", "bf16")
        for mode in ("fwd", "fwd_bwd", "train")
    ]
    quiet = {"mean_ms": 3.25, "std_ms": 0.1, **QUIET}
    rows.append(_bench("test_allreduce[x]", "allreduce", {"world_size": 2, "nbytes": "1MB"}, quiet))
    out = tmp_path / f"report-{load}"
    report.write_report([_write(tmp_path / f"r-{load}.json", rows)], out)
    return (out / "writeup.md").read_text()


def test_a_busy_run_says_so_once_and_folds_the_tables_it_emptied(tmp_path: Path) -> None:
    text = _busy_run(tmp_path, 6.33)
    summary = [line for line in text.splitlines() if "timed on a busy machine" in line]
    assert len(summary) == 1, summary
    assert "6 of the 7 rows that ran" in summary[0] and "load average 6.33 on 2 cores" in summary[0]
    assert "OMP_NUM_THREADS=1 tox -e bench" in summary[0] and "--show-unreliable" in summary[0]
    # the model table and its D4 view (by dtype): one line each, no cell of marks; the untimed column stays
    assert "| unreliable [1]" not in text and text.count("No timing in this table is a result") == 2
    assert "`tables/model-group.md` keeps its marked cells" in text
    assert "200,000,000" in text and "3.250 ± 0.1" in text  # FLOPs and the quiet row's figure
    table_file = (tmp_path / "report-6.33" / "tables" / "model-group.md").read_text()
    assert table_file.count("unreliable [1]") >= 6  # the table's own file keeps its cells
    quiet = _busy_run(tmp_path, 0.5)
    assert "busy machine" not in quiet and "No timing in this table" not in quiet
    assert "12.50 ± 1" in quiet


# ---- --compare of a file with itself: every row classified, the counts add up (issue 73) ---------------


def _every_kind_of_row() -> list[dict]:
    one_round = {"load_avg_1m": 0.5, "cpu_cores": 2.0, "rounds_n": 1.0, "mean_ms": 20.0, "std_ms": 0.0}
    stats_only = _bench("test_stats[x]", "model", {"size": "x"}, QUIET)
    stats_only["stats"] = {"mean": 0.012, "stddev": 0.001}  # pytest-benchmark's own timing only
    return [
        _sweep("banded", 1.0, (0.9, 1.1)),
        _bench("test_sweep[old]", "flash_sweep", {"impl": "old"}, {"do_bench_ms": 1.0, **QUIET}, GPU),
        _bench("test_model[spread]", "model", {"size": "a"}, {"mean_ms": 10.5, "std_ms": 0.4, **QUIET}),
        _bench("test_model[no std]", "model", {"size": "b"}, {"mean_ms": 10.5, **QUIET}),
        stats_only,
        _bench("test_grade[course]", "grading", {"case": "course"}, one_round, device=None),
        _sweep("issue", 0.03, (0.02, 0.04), launch_ms=0.05),
        _bench("test_model[busy]", "model", {"size": "c"}, {"mean_ms": 9.0, **LOADED}),
        _bench("test_flash[triton]", "flash_sweep", {"impl": "flash_triton"}, {"mean_ms": 900.0, **QUIET}),
        _bench("test_model[oom]", "model", {"size": "d"}, {"oom": True}),
        _bench("test_fused[cuda]", "fused_loss", {"impl": "x"}, {"status": "skipped", "skipped": "no GPU"}),
    ]


def _head_counts(text: str) -> tuple[int, int]:
    """(paired rows, the sum of the counts after them) of ``--compare``'s first line."""
    head = text.splitlines()[0]
    paired, _, counts = head.partition(" paired rows")
    return int(paired.rsplit(" ", 1)[1]), sum(
        int(n) for n in re.findall(r"(?:^: |, )(\d+) (?=[a-z])", counts)
    )


def test_a_file_compared_with_itself_classifies_every_row(tmp_path: Path) -> None:
    rows = _every_kind_of_row()
    path = _write(tmp_path / "a.json", rows)
    text = compare_runs(path, path)
    assert _head_counts(text) == (len(rows), len(rows)), text.splitlines()[0]
    cells = {
        line.split(" | ")[1]: line.split(" | ")[-2:]
        for line in text.splitlines()[2:]
        if line.startswith("| ")
    }
    for name, (ratio, noise) in cells.items():
        if ratio == "1×":  # the same figure on both sides is within any noise it states, or none
            assert noise in ("yes |", "host-bound |"), (name, noise)
    assert cells["test_flash_sweep[issue]"][1] == "host-bound |"
    assert "6 within noise" in text and "1 host-bound" in text and "1 timed under contention" in text
    assert "1 interpreted" in text and "1 out of memory on a side" in text and "1 not run in either" in text
    # a case that ran in B only: a class of its own, counted too
    ran = [r for r in rows if r["name"] != "test_fused[cuda]"]
    ran.append(_bench("test_fused[cuda]", "fused_loss", {"impl": "x"}, {"mean_ms": 1.0, **QUIET}))
    text = compare_runs(path, _write(tmp_path / "b.json", ran))
    assert _head_counts(text) == (len(rows), len(rows)) and "1 run on one side only" in text
