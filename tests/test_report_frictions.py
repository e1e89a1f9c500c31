"""What a new user hit (issue 38), each checked where it was fixed: timings taken under contention
are marked, not printed as results (bench rows, the CLI, the tables, ``--compare``); a results file
of another tool is refused in one line; unsupported-backend reasons are footnotes; the report runs
without torch; the D11 note on the missing FlashAttention; significant digits; the CLI's single
table and short errors. Synthetic rows, written as pytest-benchmark JSON: no bench runs here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems import report
from cs336_systems.cli import benchmark as cli
from cs336_systems.harness.record import Recorder, run_benchmark
from cs336_systems.report.answers import flash_speedups
from cs336_systems.report.load import Record
from cs336_systems.report.parallelism import parallelism_answer
from cs336_systems.rows import contention

ROOT = Path(__file__).resolve().parents[1]
QUIET = {"load_avg_1m": 1.0, "cpu_cores": 2.0, "rounds_spread": 0.02}
BUSY = {"load_avg_1m": 9.5, "cpu_cores": 2.0, "rounds_spread": 0.02}  # the issue: 60x slower, even spread


def _bench(name: str, key: str, params: dict, extra: dict, mean_s: float = 0.01) -> dict:
    extra = {"group_key": key, "device_name": "cpu (x86_64, 2 cores)", **extra}
    return {
        "group": f"{key} group",
        "name": name,
        "params": params,
        "extra_info": extra,
        "stats": {"mean": mean_s, "stddev": 0.0},
    }


def _write(path: Path, benchmarks: list[dict]) -> Path:
    path.write_text(json.dumps({"benchmarks": benchmarks, "datetime": "now", "version": "5"}))
    return path


def _warmup_rows(load: dict) -> list[dict]:
    return [
        _bench(f"test_warmup[{w}]", "warmup", {"warmup": w}, {"mean_ms": ms, "std_ms": 1.0, **load})
        for w, ms in ((0, 812.0), (5, 118.0))
    ]


# ---- contention: recorded, judged, marked -------------------------------------------------------


def test_contention_reasons() -> None:
    assert contention.contention_reasons(QUIET, on_cpu=True) == []
    assert contention.contention_reasons(BUSY, on_cpu=True) == ["load average 9.5 on 2 cores"]
    assert contention.contention_reasons(BUSY, on_cpu=False) == []  # a GPU timing: not the host's load
    spread = contention.contention_reasons({"rounds_spread": 0.6}, on_cpu=False)
    assert spread == ["rounds spread ±60%"]
    assert "MFU 105% is above 100%" in contention.contention_reasons({"mfu": 1.05}, on_cpu=False)[0]
    assert contention.rounds_spread([1.0, 1.0]) is None  # too few rounds to say
    assert contention.rounds_spread([1.0, 2.0, 3.0]) == pytest.approx(0.5)
    assert contention.rounds_spread([10.0] + [1.0] * 9) == 0.0  # a cold first step is D2's finding, not noise


def test_a_bench_row_records_the_load_and_spread(device) -> None:
    bench = Recorder()
    run_benchmark(bench, lambda: None, device, warmup=0, rounds=3)
    assert {"load_avg_1m", "cpu_cores", "rounds_spread"} <= set(bench.extra_info)


def test_tables_mark_contended_rows_instead_of_printing_them(tmp_path: Path) -> None:
    rows = _warmup_rows(BUSY)[:1] + _warmup_rows(QUIET)[1:]
    _, records = report.load([_write(tmp_path / "busy.json", rows)])
    (table,) = report.build_tables(records)
    cells = list(table.long["mean ± std (ms)"])
    assert cells == ["unreliable [1]", "118 ± 1"]
    assert table.footnotes == [
        "unreliable timing: load average 9.5 on 2 cores; the figure measures the machine's load, not the case"
    ]
    assert "load_avg_1m" not in table.long.columns and "rounds_spread" not in table.long.columns
    text = report.render.render_group_markdown(table)
    assert "[1] unreliable timing: load average 9.5 on 2 cores" in text and "812" not in text


def test_compare_gives_no_ratio_for_contended_rows(tmp_path: Path) -> None:
    a = _write(tmp_path / "a.json", _warmup_rows(QUIET))
    b_rows = _warmup_rows(QUIET)
    b_rows[0]["extra_info"].update(BUSY)
    b = _write(tmp_path / "b.json", b_rows)
    from cs336_systems.report.compare import compare_runs

    text = compare_runs(a, b)
    assert (
        "2 paired rows: 1 within noise (bands overlap: do_bench's p20–p80, else mean ± std), 1 timed under"
        in text
    )
    assert "unreliable (B: load average 9.5 on 2 cores)" in text
    assert "| 1× |" in text  # the quiet pair keeps its ratio


# ---- input from another tool -----------------------------------------------------------------------


def test_json_of_another_project_is_refused_in_one_line(tmp_path: Path, capsys) -> None:
    other = {"group": "parser", "name": "test_parse", "params": {}, "stats": {"mean": 0.1}}
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"benchmarks": [other, dict(other, name="test_dump")]}))
    ours = _write(tmp_path / "ours.json", _warmup_rows(QUIET))
    for argv in ([str(path), "--out", str(tmp_path / "r")], ["--compare", str(ours), str(path)]):
        assert report.main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "other.json holds no rows of this suite" in err
    assert not (tmp_path / "r").exists()


# ---- the writeup ----------------------------------------------------------------------------------


def _flash_rows() -> list[dict]:
    params = {"dtype": "fp32", "d": 16, "seq": 128, "pass_": "fwd_bwd"}
    reason = "sdpa_cudnn unsupported for torch.float32 d=16 on cpu: No viable backend " + "x" * 200
    return [
        _bench("pytorch", "flash_sweep", {**params, "impl": "pytorch"}, {"do_bench_ms": 1.0, **QUIET}),
        *(
            _bench(
                f"cudnn{p}",
                "flash_sweep",
                {**params, "impl": "sdpa_cudnn", "pass_": p},
                {"status": "unsupported", "reason": reason, "skipped": reason},
            )
            for p in ("fwd", "bwd", "fwd_bwd")
        ),
    ]


def test_unsupported_reason_is_one_footnote_and_flash_triton_absence_is_explained(tmp_path: Path) -> None:
    out = tmp_path / "r"
    report.write_report([_write(tmp_path / "flash.json", _flash_rows())], out)
    text = (out / "writeup.md").read_text()
    assert text.count("No viable backend") == 1  # one line under the table, not every cell
    assert "Not available on cpu (x86_64, 2 cores), so not in the table: sdpa_cudnn (torch: " in text
    assert "unsupported [" not in text  # no column of cells for a backend the machine cannot have
    assert max(len(line) for line in text.splitlines() if line.startswith("|")) < 300
    note = flash_speedups(report.load([tmp_path / "flash.json"])[1])
    assert "`flash_triton`: no row in this sweep: the bench times it on a GPU only" in note


def test_the_report_needs_no_torch(tmp_path: Path) -> None:
    """A Python without torch (any import of it fails): tables and writeup are written, the closed
    forms say what they need."""
    path = _write(tmp_path / "rows.json", _warmup_rows(QUIET) + _flash_rows())
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "from cs336_systems.report.writeup import main\n"
        f"sys.exit(main([{str(path)!r}, '--out', {str(tmp_path / 'r')!r}]))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "MPLBACKEND": "Agg"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    text = (tmp_path / "r" / "writeup.md").read_text()
    assert "mean ± std (ms)" in text and "which this Python lacks" in text


def test_significant_digits_not_fixed_decimals() -> None:
    # the CPU run: C = 0.032 TFLOP/s printed as "0.0" next to α = C/W = 32
    cpu = Record("model", "model", "m", "s", "cpu", "m", {"dtype": "bf16"}, {"matmul_tflops": 0.032})
    gloo = Record("D13", "allreduce", "a", "s", "cpu", "m", {"backend": "gloo"}, {"busbw_gbps": 1.0})
    text = parallelism_answer([cpu, gloo])
    assert "C = 0.032 TFLOP/s" in text and "W = 1 GB/s" in text and "α = C/W = 32 " in text
    row = {"case": "c", "mean_ms": 793.2, "std_ms": 17.0, "tflops": 0.0041, "mfu": 0.123}
    cells = cli._cells(row)
    assert cells[1:3] == ["793.2", "17"] and cells[4] == "0.0041" and cells[5] == "12.3"


# ---- the benchmark CLI ------------------------------------------------------------------------------


def test_cli_prints_each_row_once_and_marks_contention(capsys) -> None:
    printer = cli.RowPrinter(case_width=8)
    printer.row({"case": "calm", "mean_ms": 12.0, "std_ms": 0.1, **QUIET})
    printer.row(
        {"case": "busy", "mean_ms": 793.0, "std_ms": 17.0, "contention": "load average 9.5 on 2 cores"}
    )
    out = capsys.readouterr().out
    assert out.count("| case") == 1 and out.count("calm") == 1 and "793" not in out
    assert "busy     | unreliable" in out and "^ unreliable timing: load average 9.5 on 2 cores" in out


def test_cli_errors_without_the_usage_block(capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.main(["--steps", "0", "--device", "cpu"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "error: need --warmup >= 0 and --steps >= 1" in err
    assert "usage:" not in err and "--help lists the options" in err


def test_readme_gives_the_thread_advice_with_the_main_job_and_the_report_needs() -> None:
    readme = (ROOT / "README.md").read_text()
    main_job = readme[readme.index("**Main job") : readme.index("**Tests**")]
    assert "OMP_NUM_THREADS=1" in main_job and "unreliable [n]" in main_job
    assert "pandas, tabulate and matplotlib" in readme and "not torch" in readme


def test_value_columns_are_named_in_words_not_raw_keys(tmp_path: Path) -> None:
    """Issue 73: ``first_ms`` and ``tune_seconds_so_far`` were column headers as written in the JSON."""
    extra = {"mean_ms": 10.0, "std_ms": 0.1, "tune_seconds_so_far": 1.5, **QUIET}
    rows = [
        _bench(f"test_x[{n}]", "friction", {"seq": n}, {**extra, "first_ms": 30.0 + n, "do_bench_p80_ms": n})
        for n in (64, 128)
    ]
    _, records = report.load([_write(tmp_path / "x.json", rows)])
    (table,) = report.build_tables(records)
    values = list(table.long.columns[table.index_columns :])
    assert {"first step (ms)", "autotuning so far (s)", "do bench p80 (ms)"} <= set(values), values
    assert not any("_" in column for column in values), values
