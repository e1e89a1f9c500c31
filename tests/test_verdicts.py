"""One reliability verdict per row (issue 51): the rounds' spread decides before the load average,
and the verdict travels with the row into every output (tables, ``--compare``, the CLI, plots,
ratios). Synthetic rows only: no bench runs here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cs336_systems import report
from cs336_systems.cli import benchmark as cli
from cs336_systems.profiling.flops import dense_bf16_peak_tflops, mfu_both
from cs336_systems.rows import contention

LOADED = {"load_avg_1m": 7.8, "cpu_cores": 2.0}
TIGHT = {**LOADED, "rounds_spread": 0.035, "rounds_n": 10.0}  # the 3.5% row at load 3.9/core
LOOSE = {**LOADED, "rounds_spread": 0.18, "rounds_n": 10.0}  # between TIGHT and SPREAD: the load decides
FEW = {**LOADED, "rounds_spread": 0.035, "rounds_n": 3.0}  # too few rounds to overrule the load


def test_rounds_that_agree_are_a_result_on_a_loaded_machine() -> None:
    assert contention.contention_reasons(TIGHT, on_cpu=True) == []
    assert contention.contention_reasons(LOOSE, on_cpu=True) == ["load average 7.8 on 2 cores"]
    assert contention.contention_reasons(FEW, on_cpu=True) == ["load average 7.8 on 2 cores"]
    wild = {**TIGHT, "rounds_spread": 0.4}
    assert contention.contention_reasons(wild, on_cpu=False) == ["rounds spread ±40%"]
    assert contention.contention_reasons({**TIGHT, "mfu": 1.2}, on_cpu=True)[0].startswith("MFU 120%")


def test_rows_record_how_many_rounds_they_had() -> None:
    facts = contention.contention_facts([1.0, 1.01, 0.99, 1.0, 1.02])
    assert facts["rounds_n"] == 5 and facts["rounds_spread"] < contention.TIGHT
    assert contention.rounds_agree(facts)


def test_cli_keeps_a_tight_row_and_shows_unreliable_numbers_on_request(capsys) -> None:
    row = {"case": "busy", "mean_ms": 773.0, "std_ms": 90.0, "tflops": 0.01, "contention": "load average 9"}
    assert cli._cells(row)[1] == "unreliable"
    shown = cli._cells(row, show_unreliable=True)
    assert shown[1] == "773*" and shown[4] == "0.01*"
    printer = cli.RowPrinter(case_width=6, show_unreliable=True)
    printer.row(row)
    assert "^ * unreliable timing: load average 9" in capsys.readouterr().out


def test_mfu_both_names_its_denominators() -> None:
    both = mfu_both(500e12, 781e12, "NVIDIA H100 80GB HBM3")
    assert both["mfu"] == pytest.approx(500 / 781) and both["mfu_peak"] == pytest.approx(500 / 989)
    assert "measured matmul rate 781" in both["mfu_note"] and "dense bf16 peak 989" in both["mfu_note"]
    assert dense_bf16_peak_tflops("NVIDIA H100 PCIe") == 756 and dense_bf16_peak_tflops("NVIDIA H200") == 989
    unknown = mfu_both(500e12, 781e12, "NVIDIA GeForce RTX 4090")
    assert "mfu_peak" not in unknown and "measured rate only" in unknown["mfu_note"]


def test_cli_prints_both_mfus_and_the_flop_formula() -> None:
    legend = cli.mfu_legend("NVIDIA H100 80GB HBM3", {"bf16": 781.0})
    assert "MFU % meas" in legend and "MFU % peak" in legend and "H100 989" in legend
    assert "recomputation" in legend and "bf16 781" in legend
    cells = cli._cells({"case": "c", "mean_ms": 10.0, "mfu": 0.587, "mfu_peak": 0.46})
    assert cells[5:7] == ["58.7", "46"]


def _bench(name: str, key: str, params: dict, extra: dict, group: str | None = None) -> dict:
    extra = {"group_key": key, "device_name": "cpu (x86_64, 2 cores)", **extra}
    return {
        "group": group or f"{key} group",
        "name": name,
        "params": params,
        "extra_info": extra,
        "stats": {"mean": 0.01, "stddev": 0.0},
    }


def _write(path: Path, benchmarks: list[dict]) -> Path:
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": "now", "version": "5"}))
    return path


def test_tables_show_a_tight_row_on_a_loaded_machine(tmp_path: Path) -> None:
    rows = [
        _bench("test_warmup[0]", "warmup", {"warmup": 0}, {"mean_ms": 21.4, "std_ms": 0.5, **TIGHT}),
        _bench("test_warmup[5]", "warmup", {"warmup": 5}, {"mean_ms": 773.0, "std_ms": 90.0, **LOOSE}),
    ]
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    (table,) = report.build_tables(records)
    assert list(table.long["mean ± std (ms)"]) == ["21.40 ± 0.5", "unreliable [1]"]


# ---- breaks the tests used to let through (issue 51) -------------------------------------------------


def _step_rows(warmup_ms: float, model_ms: float) -> list[dict]:
    """A warm-up row and a model row with the same benchmark name, as D2's two groups write them."""
    quiet = {"load_avg_1m": 0.5, "cpu_cores": 2.0, "rounds_spread": 0.01, "rounds_n": 10.0}
    return [
        _bench(
            "test_step[tiny]", "warmup", {"warmup": 0}, {"mean_ms": warmup_ms, **quiet}, "D2 warm-up tiny"
        ),
        _bench(
            "test_step[tiny]",
            "model",
            {"mode": "fwd"},
            {"mean_ms": model_ms, **quiet},
            "D2/D4/D7b model tiny",
        ),
    ]


def test_compare_pairs_by_group_and_name_not_by_name(tmp_path: Path) -> None:
    from cs336_systems.report.compare import compare_runs

    a = _write(tmp_path / "a.json", _step_rows(10.0, 100.0))
    b = _write(tmp_path / "b.json", _step_rows(20.0, 200.0))
    text = compare_runs(a, b)
    assert "2 paired rows" in text and text.count("| 2× |") == 2
    assert "20×" not in text and "0.2×" not in text


def test_latex_tables_keep_their_footnotes(tmp_path: Path) -> None:
    reason = "cuDNN attention needs a CUDA GPU"
    rows = [
        _bench("test_warmup[0]", "warmup", {"warmup": 0}, {"mean_ms": 773.0, **LOOSE}),
        _bench(
            "test_warmup[5]",
            "warmup",
            {"warmup": 5},
            {"status": "skipped", "reason": reason, "skipped": reason},
        ),
    ]
    path = _write(tmp_path / "r.json", rows)
    _, records = report.load([path])
    (table,) = report.build_tables(records)
    latex = report.render.render_group_latex(table)
    assert "unreliable [1]" in latex and "skipped [2]" in latex
    assert "[1] unreliable timing: load average 7.8 on 2 cores" in latex and f"[2] {reason}" in latex
    out = tmp_path / "tex"
    assert report.main([str(path), "--format", "latex", "--out", str(out)]) == 0
    (tex,) = (out / "tables").glob("*.tex")
    assert "\\footnotesize [1] unreliable timing" in tex.read_text() and reason in tex.read_text()


# ---- no ratio from a row whose timing is not a result ----------------------------------------------

GPU = "NVIDIA H100 80GB HBM3"
WILD = {"rounds_spread": 0.4, "rounds_n": 10.0}


def _rec(key: str, name: str, desc: dict, values: dict, device: str = GPU) -> report.Record:
    return report.Record(f"{key} group", key, name, "s", device, "m", desc, values)


def test_fsdp_prose_gives_no_step_ratio_from_an_unreliable_row() -> None:
    from cs336_systems.report.answers.memory import d24b

    setting = {"size": "xl", "ctx": 512, "dtype": "bf16", "world_size": 2}
    ours = _rec(
        "fsdp", "ours", {**setting, "variant": "fsdp_blocks"}, {"mean_ms": 50.0, "time_vs_fsdp2": 0.5}
    )
    fsdp2 = _rec("fsdp", "fsdp2", {**setting, "variant": "fsdp2_blocks"}, {"mean_ms": 100.0, **WILD})
    assert "0.50× torch's fully_shard" in d24b(
        [ours, _rec("fsdp", "fsdp2", fsdp2.descriptors, {"mean_ms": 100.0})]
    )
    text = d24b([ours, fsdp2])
    assert "0.50×" not in text and "not derived: fsdp2's timing is not a result (rounds spread ±40%)" in text


def test_proxy_ratio_is_not_derived_from_an_unreliable_row() -> None:
    from cs336_systems.report.proxy_8b import proxy_answer

    ours = _rec("proxy_8b", "ours", {"row": "ours"}, {"step_s": 1.0})
    torch_ = _rec("proxy_8b", "torch", {"row": "torch"}, {"step_s": 1.25, **WILD})
    assert "0.800×" in proxy_answer([ours, _rec("proxy_8b", "torch", {"row": "torch"}, {"step_s": 1.25})])
    assert "not derived: torch's timing" in proxy_answer([ours, torch_])


def test_interpreted_triton_rows_are_no_figure_and_give_no_ratio(tmp_path: Path) -> None:
    cpu = "cpu (x86_64, 2 cores)"
    quiet = {"rounds_spread": 0.01, "rounds_n": 10.0}
    ours = _rec(
        "attention_shapes",
        "ours",
        {"impl": "flash_triton"},
        {"mean_ms": 670.0, "ratio_to_best_sdpa": 670.0, **quiet},
        cpu,
    )
    adamw = _rec(
        "fused_adamw",
        "adamw",
        {"impl": "triton_fused"},
        {"median_ms": 2144.0, "time_vs_torch_fused": 2144.0, **quiet},
        cpu,
    )
    torch_adamw = _rec("fused_adamw", "torch", {"impl": "torch_fused"}, {"median_ms": 1.0, **quiet}, cpu)
    on_gpu = _rec(
        "attention_shapes", "gpu", {"impl": "flash_triton"}, {"mean_ms": 4.7, "ratio_to_best_sdpa": 0.9}, GPU
    )
    for group in ([ours], [adamw, torch_adamw]):
        (table,) = report.build_tables(group)
        cells = " ".join(table.long.astype(str).to_numpy().ravel())
        assert "670" not in cells and "2,144" not in cells and "2144" not in cells
        assert "interpreted [1]" in cells and "TRITON_INTERPRET=1" in table.footnotes[0]
        assert len(table.footnotes) == 1
    (table,) = report.build_tables([torch_adamw])
    assert "interpreted" not in " ".join(table.long.astype(str).to_numpy().ravel())  # torch's own AdamW
    (table,) = report.build_tables([on_gpu])
    assert list(table.long.iloc[0]) == ["4.700", "0.9"]


def test_bench_terminal_table_and_report_give_one_verdict(tmp_path: Path) -> None:
    """pytest-benchmark's terminal table (bench/conftest.py, through ``row_verdict``) marks exactly the
    rows the report marks."""
    cases = [TIGHT, LOOSE, FEW, {**TIGHT, "rounds_spread": 0.4}, {"load_avg_1m": 0.1, "cpu_cores": 2.0}]
    rows = [
        _bench(f"test_x[{i}]", "warmup", {"warmup": i}, {"mean_ms": 5.0, **c}) for i, c in enumerate(cases)
    ]
    rows.append(_bench("test_y", "fused_adamw", {"impl": "triton_fused"}, {"median_ms": 9.0}))
    _, records = report.load([_write(tmp_path / "r.json", rows)])
    from cs336_systems.report.load import unreliable

    by_report = {r.name: unreliable(r) for r in records}
    by_terminal = {b["name"]: contention.row_verdict(b["extra_info"], b["params"]) for b in rows}
    assert by_report == by_terminal
    assert [n for n, v in by_report.items() if v] == ["test_x[1]", "test_x[2]", "test_x[3]", "test_y"]


def test_report_show_unreliable_prints_the_figures_with_their_mark(tmp_path: Path, capsys) -> None:
    rows = [
        _bench("test_warmup[0]", "warmup", {"warmup": 0}, {"mean_ms": 773.0, "std_ms": 90.0, **LOOSE}),
        _bench("test_warmup[5]", "warmup", {"warmup": 5}, {"mean_ms": 21.4, "std_ms": 0.5, **TIGHT}),
    ]
    path = _write(tmp_path / "r.json", rows)
    out = tmp_path / "shown"
    assert report.main([str(path), "--out", str(out), "--show-unreliable"]) == 0
    text = (out / "writeup.md").read_text()
    assert "773 ± 90 (unreliable [1])" in text and "[1] unreliable timing: load average 7.8" in text
    assert report.main([str(path), "--out", str(tmp_path / "hidden")]) == 0
    assert "773" not in (tmp_path / "hidden" / "writeup.md").read_text()
    quiet = _write(tmp_path / "q.json", [dict(r, extra_info={**r["extra_info"], **TIGHT}) for r in rows])
    capsys.readouterr()
    assert report.main(["--compare", str(quiet), str(path), "--show-unreliable"]) == 0
    assert "| 1× unreliable (B: load average 7.8 on 2 cores) |" in capsys.readouterr().out


def test_train_8b_prints_the_verdict_and_both_mfus() -> None:
    from cs336_systems.cli.train_8b import judged

    steady = {"times_ms": [5276.0, 5280.0, 5290.0], "tflops_per_gpu": 449.6, "matmul_tflops": 783.9}
    lines = judged(steady, "NVIDIA H100 80GB HBM3")
    assert len(lines) == 1 and "57.4% of the measured matmul rate" in lines[0]
    assert "45.5% of the dense bf16 peak 989" in lines[0] and "6N per token" in lines[0]
    assert steady["mfu_peak"] == pytest.approx(449.6 / 989) and "contention" not in steady
    wild = {"times_ms": [5000.0, 9000.0, 5200.0, 14000.0]}
    (line,) = judged(wild, "NVIDIA H100 80GB HBM3")
    assert line.startswith("unreliable timing: rounds spread") and wild["contention"]


def _bench_conftest():
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "conftest.py"
    spec = importlib.util.spec_from_file_location("bench_conftest_under_test", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_terminal_table_marks_rows_and_explains_deselected_cases() -> None:
    conftest = _bench_conftest()
    rows = [
        {"name": "test_a[quiet]", "extra_info": {"device_name": "cpu (x86_64, 2 cores)", **TIGHT}},
        {"name": "test_a[busy]", "extra_info": {"device_name": "cpu (x86_64, 2 cores)", **LOOSE}},
        {"name": "test_b[ours]", "params": {"impl": "triton_fused"}, "extra_info": {"device_name": "cpu"}},
        {"name": "test_c[oom]", "extra_info": {"oom": True, **LOOSE}},
    ]
    assert conftest._mark_verdicts(rows) == {"unreliable": 1, "interpreted": 1}
    names = [r["name"] for r in rows]
    assert names == [
        "test_a[quiet]",
        "test_a[busy] (unreliable)",
        "test_b[ours] (interpreted)",
        "test_c[oom]",
    ]

    from types import SimpleNamespace

    config = SimpleNamespace(stash={})

    class Item:
        def __init__(self, adapters: bool) -> None:
            self.adapters, self.config = adapters, config

        def get_closest_marker(self, name: str):
            return object() if self.adapters and name == conftest.ADAPTERS_ROW else None

    conftest.pytest_deselected([Item(True), Item(True), Item(False)])
    assert config.stash[conftest._NO_ADAPTERS] == 2


def test_a_stored_ratio_whose_reference_row_is_unreliable_is_not_shown() -> None:
    """ours / best SDPA sits on ours' row; when the SDPA row of the same case is no result, neither is
    the ratio, while another case's ratio stays."""
    rows = [
        _rec("attention_shapes", "sdpa", {"shape": "a", "impl": "sdpa_flash"}, {"mean_ms": 7.0, **WILD}),
        _rec(
            "attention_shapes",
            "ours",
            {"shape": "a", "impl": "flash_triton"},
            {"mean_ms": 4.8, "ratio_to_best_sdpa": 0.68},
        ),
        _rec("attention_shapes", "sdpa b", {"shape": "b", "impl": "sdpa_flash"}, {"mean_ms": 7.0}),
        _rec(
            "attention_shapes",
            "ours b",
            {"shape": "b", "impl": "flash_triton"},
            {"mean_ms": 4.9, "ratio_to_best_sdpa": 0.7},
        ),
    ]
    (table,) = report.build_tables(rows)
    ratio_of_a = table.long[(table.long["shape"] == "a") & (table.long["impl"] == "flash_triton")][
        "ours / best SDPA"
    ]
    ratio_of_b = table.long[(table.long["shape"] == "b") & (table.long["impl"] == "flash_triton")][
        "ours / best SDPA"
    ]
    assert ratio_of_a.item().startswith("unreliable [") and ratio_of_b.item() == "0.7"
    assert any(
        n.startswith("Ratio not derived: sdpa's timing is not a result (rounds spread")
        for n in table.footnotes
    )
    assert len(table.long) == 4


# ---- Triton kernels a row names by a flag or a piece (issue 57) -------------------------------------

CPU = "cpu (x86_64, 2 cores)"


def test_a_fused_loss_row_on_a_cpu_is_interpreted_in_the_report_as_in_the_cli(tmp_path: Path) -> None:
    """The model's fused loss runs the fused cross-entropy Triton kernel; the benchmark CLI's
    ``--fused-loss --json`` row (and a bench model row) says so with ``fused_loss: true`` only."""
    quiet = {"rounds_spread": 0.01, "rounds_n": 10.0, "device_name": CPU}
    fused = {"case": "tiny-fusedloss", "size": "tiny", "mean_ms": 900.0, "fused_loss": True, **quiet}
    plain = {**fused, "case": "tiny", "mean_ms": 80.5, "fused_loss": False}
    path = tmp_path / "cli.json"
    path.write_text(json.dumps([fused, plain]))
    _, records = report.load([path])
    from cs336_systems.report.load import unreliable

    assert {r.name: unreliable(r) for r in records} == {
        "tiny-fusedloss": contention.INTERPRETER_NOTE,
        "tiny": None,
    }
    assert contention.row_verdict(fused) == contention.INTERPRETER_NOTE  # what the CLI printed
    (table,) = report.build_tables(records)
    cells = " ".join(table.long.astype(str).to_numpy().ravel())
    assert "900" not in cells and "interpreted [1]" in cells and "80.50" in cells


def test_the_8b_steps_triton_pieces_are_interpreted_on_a_cpu() -> None:
    from cs336_systems.cli.train_8b import judged
    from cs336_systems.training.options import TRITON_PIECES

    for piece, (ours, torch_piece) in TRITON_PIECES.items():
        assert contention.interpreted({piece: ours}, on_cpu=True), piece
        assert contention.interpreted({"pieces": {piece: ours}}, on_cpu=True), piece  # a bench row
        assert not contention.interpreted({piece: torch_piece}, on_cpu=True), piece
        assert not contention.interpreted({piece: ours}, on_cpu=False), piece
    steady = [5276.0, 5280.0, 5290.0, 5281.0, 5279.0]
    swapped = {"attention": "sdpa", "loss": "chunked", "optimizer": "torch_fused"}
    result = {"times_ms": steady, "options": {**swapped, "loss": "fused"}}
    assert judged(result, CPU) == [f"interpreted: {contention.INTERPRETER_NOTE}"]
    assert result["contention"] == contention.INTERPRETER_NOTE
    calm = {"times_ms": steady, "options": swapped}
    assert judged(calm, CPU) == [] and "contention" not in calm


# ---- one row, two timers (issue 57) -----------------------------------------------------------------


def _sweep_row(name: str, host_ms: float, do_bench_ms: float) -> dict:
    """A D11 sweep row as bench_flash writes it: do_bench's median (the result) and pytest-benchmark's
    host-timed rounds (its stats, in seconds, and extra_info mean_ms / median_ms)."""
    params = {"impl": name, "dtype": "fp32", "d": 16, "seq": 128, "pass_": "fwd_bwd"}
    extra = {"do_bench_ms": do_bench_ms, "mean_ms": host_ms, "median_ms": host_ms, "timer": "host", **TIGHT}
    row = _bench(f"test_flash_sweep[{name}-fp32-d16-seq128-fwd_bwd]", "flash_sweep", params, extra)
    return {**row, "stats": {"mean": host_ms / 1e3, "median": host_ms / 1e3, "stddev": 0.0}}


def test_a_row_whose_two_timers_disagree_is_marked_and_names_its_result(tmp_path: Path) -> None:
    far = _sweep_row("sdpa_flash", 215.962, 0.178)  # the row: pytest median 216 ms, do_bench 0.178
    near = _sweep_row("pytorch", 0.11, 0.0064)  # 17x, but launch + sync overhead: 0.1 ms
    _, records = report.load([_write(tmp_path / "r.json", [far, near])])
    (table,) = report.build_tables(records)
    by_impl = {row["impl"]: row for row in table.long.to_dict("records")}
    assert by_impl["sdpa_flash"]["median (ms)"] == "timers disagree [1]"
    assert by_impl["sdpa_flash"]["mean ± std (ms)"] == "timers disagree [1]"
    assert by_impl["sdpa_flash"]["do_bench median (ms)"] == "0.178"  # the result stands
    assert by_impl["pytorch"]["median (ms)"] == "0.11" and len(table.footnotes) == 1
    note = table.footnotes[0]
    assert "216 ms" in note and "0.178 ms" in note and "result is its do_bench median" in note
    assert "216" not in " ".join(table.pivot.astype(str).to_numpy().ravel())  # the D11 view: do_bench only
    # pytest-benchmark's terminal table (whose columns are the host-timed rounds) marks the row too
    shown = [dict(b, name=b["name"]) for b in (far, near)]
    assert _bench_conftest()._mark_verdicts(shown) == {"timers disagree": 1}
    assert shown[0]["name"].endswith("(timers disagree)") and not shown[1]["name"].endswith(")")
    # --compare times a do_bench row by its result, not by the timer that disagrees with it
    from cs336_systems.report.compare import compare_runs

    again = _write(tmp_path / "b.json", [_sweep_row("sdpa_flash", 0.2, 0.178 * 2)])
    assert "| 2× |" in compare_runs(_write(tmp_path / "a.json", [far]), again)
