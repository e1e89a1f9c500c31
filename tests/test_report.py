"""The report on JSON the suite itself produces: ``tests/data/sample_benches.py`` is run by pytest-
benchmark in a subprocess (real ``--benchmark-json`` output, recorded through the suite's
``run_benchmark`` / ``record_oom``), then turned into tables, plots and writeup.md. Also checks the
compare workflow docs/comparing-runs.md documents (save, ``pytest-benchmark compare``, the regression gate).
"""

from __future__ import annotations

import copy
import fcntl
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from cs336_systems import report

ROOT = Path(__file__).resolve().parents[1]
SAMPLE = ROOT / "tests" / "data" / "sample_benches.py"


def _env(**extra: str) -> dict[str, str]:
    """The child's environment: PYTHONPATH=src, and no PYTEST_* (PYTEST_ADDOPTS, and under -n the
    PYTEST_XDIST_WORKER that makes pytest-benchmark disable itself as if the child ran in parallel)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    env.update(PYTHONPATH=str(ROOT / "src"), **extra)
    return env


def _pytest(*args: str, work: int = 1, timeout: int = 120) -> subprocess.CompletedProcess[str]:
    env = _env(SAMPLE_WORK=str(work))
    cmd = [sys.executable, "-m", "pytest", str(SAMPLE), "-q", "-p", "no:cacheprovider", *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _forget_the_load(path: Path) -> None:
    """These tests check what the report makes of the rows, whatever the machine's load while the
    sample ran: its contention facts go (test_report_reliability.py judges them on their own), and a
    stddev the load pushed above its mean (three rounds, one of them 5x the others) is cut to the mean."""
    from cs336_systems.report.load import CONTENTION_KEYS

    data = json.loads(path.read_text())
    for bench in data["benchmarks"]:
        extra = bench.get("extra_info", {})
        for key in CONTENTION_KEYS:
            extra.pop(key, None)
        for std in [k for k in extra if k.endswith("std_ms")]:
            mean = extra.get("mean_ms") if std == "std_ms" else extra.get(std.replace("_std_ms", "_ms"))
            if isinstance(mean, int | float) and isinstance(extra[std], int | float):
                extra[std] = min(extra[std], mean)
        stats = bench.get("stats") or {}
        if isinstance(stats.get("mean"), int | float) and isinstance(stats.get("stddev"), int | float):
            stats["stddev"] = min(stats["stddev"], stats["mean"])
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def sample_json(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample session's JSON, made once per test session (shared by xdist workers: their base temp
    dirs sit in one per-session directory)."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent
    path = root / "report-sample.json"
    with open(root / "report-sample.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not path.exists():
            partial = path.with_suffix(".partial")
            proc = _pytest(f"--benchmark-json={partial}")
            assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
            _forget_the_load(partial)
            partial.rename(path)
    return path


@pytest.fixture(scope="module")
def records(sample_json: Path) -> list[report.Record]:
    return report.load([sample_json])[1]


def _table(records: list[report.Record], group_prefix: str) -> report.GroupTable:
    tables = report.build_tables(records)
    return next(t for t in tables if t.group.startswith(group_prefix))


def test_sample_json_is_pytest_benchmark_output(sample_json: Path) -> None:
    data = json.loads(sample_json.read_text())
    assert {"machine_info", "commit_info", "benchmarks", "datetime", "version"} <= set(data)
    groups = {b["group"] for b in data["benchmarks"]}
    assert {
        "D2/D4/D7b model tiny",
        "D6/D7a attention eager vs compiled",
        "D11 flash sweep",
        "D13 all-reduce",
    } <= groups
    assert sum(bool(b["extra_info"].get("oom")) for b in data["benchmarks"]) == 2


def test_records_split_params_and_values(records: list[report.Record]) -> None:
    row = next(r for r in records if r.name == "test_model[tiny-32-train]")
    assert row.descriptors["ctx"] == 32 and row.descriptors["mode"] == "train"
    assert row.descriptors["dtype"] == "fp32"  # a parameter-like extra_info key
    assert row.descriptors["device"] == "cpu"  # extra_info device_name wins over machine_info
    assert {"mean_ms", "std_ms", "mfu", "tokens_per_s"} <= set(row.values)
    assert "ctx" not in row.values
    unknown = next(r for r in records if r.group.startswith("misc"))
    assert "stats_mean_ms" in unknown.values  # no extra_info mean_ms: pytest-benchmark's own stats
    assert unknown.device == unknown.machine != "cpu"  # no device_name in the group: the JSON's machine
    # A row without device_name takes the one the rest of its group names.
    unsupported = next(r for r in records if r.texts.get("status") == "unsupported")
    assert unsupported.device == "cpu" and "device_name" not in unsupported.texts


def test_group_table_long_and_pivot(records: list[report.Record]) -> None:
    t = _table(records, "D6/D7a")
    assert t.fixed["d"] == 16 and t.fixed["device"] == "cpu"
    assert list(t.long.columns[:2]) == ["impl", "seq"]
    oom = t.long[t.long["seq"] == "4096"]
    assert len(oom) == 2 and (oom["fwd (ms)"] == "OOM").all() and (oom["mean ± std (ms)"] == "OOM").all()
    ok = t.long[(t.long["seq"] == "64") & (t.long["impl"] == "pytorch")]
    assert " ± " in ok["mean ± std (ms)"].item()
    # Pivot: one row per seq (sorted numerically), one column per value and implementation.
    assert t.pivot is not None
    assert list(t.pivot["seq"]) == ["64", "128", "4096"]
    assert "fwd (ms): pytorch_compiled" in t.pivot.columns
    assert "mem before bwd (MiB): pytorch" in t.pivot.columns


def test_d11_pivot_and_d13_sizes(records: list[report.Record]) -> None:
    flash = _table(records, "D11")
    assert flash.pivot is not None
    assert {"triton / fwd", "triton / fwd_bwd", "pytorch / fwd"} <= set(flash.pivot.columns)
    assert list(flash.pivot.columns[:2]) == ["d", "seq"]
    row = flash.pivot[(flash.pivot["d"] == "32") & (flash.pivot["seq"] == "256")]
    # a short marker in the cell, the reason once, as the footnote it points to (issue 38)
    notes = flash.footnotes
    unsupported = notes.index("stand-in for a backend without this case") + 1
    assert row["triton / fwd"].item() == f"unsupported [{unsupported}]"
    # a "triton" row on a CPU timed Triton's interpreter: marked, not a figure (issue 51)
    interpreted = next(i for i, n in enumerate(notes, 1) if "TRITON_INTERPRET=1" in n)
    assert row["triton / fwd_bwd"].item() == f"interpreted [{interpreted}]" and len(notes) == 2
    assert "reason" not in flash.long.columns and "note" not in flash.long.columns
    assert list(flash.pivot.columns[2:5]) == ["pytorch / fwd", "pytorch / fwd_bwd", "triton / fwd"]
    allreduce = _table(records, "D13")
    assert allreduce.fixed["backend"] == "gloo"
    assert list(allreduce.long["nbytes"][:2]) == ["1MB", "10MB"]  # sorted by size, not as text
    assert allreduce.long["busbw (GB/s)"].notna().all()


def test_another_view_of_a_group(records: list[report.Record]) -> None:
    t = _table(records, "D6/D7a")
    view = t.view(report.PivotSpec((("seq",),), ("fwd_ms",)))
    assert view is not None and list(view.columns) == ["impl", "64", "128", "4096"]
    assert t.view(report.PivotSpec((("no_such_param",),), ("fwd_ms",))) is None


def test_unknown_group_gets_a_generic_table(records: list[report.Record]) -> None:
    t = _table(records, "misc")
    assert t.pivot is None
    assert list(t.long.columns) == ["n", "mean ± std (ms, pytest-benchmark)", "answer"]
    assert list(t.long["answer"]) == ["16", "32"]


def test_merged_runs_keep_their_device(sample_json: Path, tmp_path: Path) -> None:
    data = json.loads(sample_json.read_text())
    gpu = copy.deepcopy(data)
    for bench in gpu["benchmarks"]:
        bench["extra_info"]["device_name"] = "NVIDIA H100 80GB HBM3"  # every row, OOM rows too
    gpu_path = tmp_path / "h100.json"
    gpu_path.write_text(json.dumps(gpu))
    runs, records = report.load([sample_json, gpu_path])
    assert len(records) == 2 * len(data["benchmarks"])
    assert runs[1].devices == {"NVIDIA H100 80GB HBM3"}
    t = _table(records, "D11")
    assert "device" not in t.fixed and t.long.columns[0] == "device"
    assert t.pivot is not None and t.pivot.columns[0] == "device"
    assert len(t.pivot) == 2 * 4  # (d, seq) rows per device
    # Same case from two files on the same device: the source file becomes a column too.
    again = tmp_path / "again.json"
    again.write_text(sample_json.read_text())
    _, twice = report.load([sample_json, again])
    assert {twice[0].descriptors["source"], twice[-1].descriptors["source"]} == {sample_json.stem, "again"}


def test_cli_writes_tables_plots_and_writeup(sample_json: Path, tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert report.main([str(sample_json), "--out", str(out)]) == 0
    tables = sorted(p.name for p in (out / "tables").iterdir())
    assert "d6-d7a-attention-eager-vs-compiled.md" in tables and "d11-flash-sweep.md" in tables
    assert len(tables) == 7
    for name in ("allreduce.png", "attention.png", "flash.png"):
        png = out / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (out / "writeup.md").read_text()
    for expected in (
        "## 1.1.3 End-to-end benchmarking",
        "### D6/D7a attention eager vs compiled",
        "| OOM ",
        "![D13](plots/allreduce.png)",
        "20 MiB",  # D5d
        "**44 H100 80GB**",  # D18a
        "**N_FSDP = 38**",  # D18b
        "396 tokens",  # D18c
        "3Φ(N−1)/N = 11.99 GB",  # D20c
        "## Other benchmark groups",
        "The run ran out at seq 4096, d 16",  # sample OOM far below the accounting's prediction
        # D11: the sample's "triton" rows ran on a CPU (the interpreter): no speed-up from them (issue 51)
        "whose timing is not a result (see the table's footnotes) are left out of the speed-ups",
        "| pytorch | 16 | 128 | saved | 0.562 | 0.562 | 1.00 |",  # D6: P + O kept, as accounted
        "| unsharded | tiny | 2 | 5.384 / 5.384 | 21.54 / 21.54 | 22.54 / 21.54 |",  # D20 vs accounting
    ):
        assert expected in text, expected
    # D17b from the sample's synthetic all-reduce cost t = 2e-4·(world/2)… s + n / 1 GB/s (gloo, 2 ranks).
    assert "w = 1.0 GB/s, o = 200.0 µs" in text


def test_cli_latex(sample_json: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "tex"
    assert report.main([str(sample_json), "--format", "latex", "--out", str(out)]) == 0
    tex = (out / "tables" / "d13-all-reduce.tex").read_text()
    assert "\\begin{tabular}" in tex and "$\\pm$" in tex and "world\\_size" in tex
    assert (out / "writeup.md").exists()

    # Without jinja2 (pandas' to_latex needs it), tabulate writes the same cells.
    def no_jinja(*args, **kwargs):
        raise ImportError("jinja2")

    monkeypatch.setattr(pd.DataFrame, "to_latex", no_jinja)
    fallback = report.to_latex(pd.DataFrame({"a_b": ["1 ± 2"]}), "cap_tion")
    assert "a\\_b" in fallback and "1 $\\pm$ 2" in fallback and "\\caption{cap\\_tion}" in fallback


def test_bad_input_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    assert report.main([str(missing), "--out", str(tmp_path / "o")]) == 2
    assert "nope.json" in capsys.readouterr().err
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ValueError, match=r"other\.json is neither pytest-benchmark JSON"):
        report.load([other])
    with pytest.raises(ValueError, match="format"):
        report.write_report([], tmp_path / "x", fmt="html")


def test_run_without_d13_still_writes_the_accounting(sample_json: Path, tmp_path: Path) -> None:
    data = json.loads(sample_json.read_text())
    # the misc rows (outside the schema) and the D2 warm-up ones: a file of this suite without D13
    data["benchmarks"] = [b for b in data["benchmarks"] if b["group"].startswith(("misc", "D2 warm"))]
    only_misc = tmp_path / "misc.json"
    only_misc.write_text(json.dumps(data))
    result = report.write_report([only_misc], tmp_path / "out")
    text = result["writeup"].read_text()
    assert result["records"] == len(data["benchmarks"]) > 2 and "No rows for this part" in text
    # No D13 data: the D17b numbers fall back to the reference NCCL timing.
    assert "reference NCCL timing measured on 2 × H200" in text and "**44 H100 80GB**" in text


@pytest.mark.parametrize(
    "text, nbytes",
    # MB means MiB, as bucket_size_mb and the all-reduce sizes do (units.py): one definition.
    [
        ("1MB", 2**20),
        ("10 MB", 10 * 2**20),
        ("1GiB", 2**30),
        ("100MiB", 100 * 2**20),
        (1048576, 2**20),
        ("x", None),
    ],
)
def test_parse_size(text, nbytes) -> None:
    assert report.parse_size(text) == nbytes


def test_formatting() -> None:
    assert report.format_size(2**20) == "1 MiB" and report.format_size(10**9) == "1 GB"
    assert report.format_number("mfu", 0.4012) == "40.1%"
    assert (
        report.format_number("mean_ms", 86.5) == "86.50"
        and report.format_number("mean_ms", 0.0341) == "0.0341"
    )
    assert report.format_number("tokens_per_s", 123456.7) == "123,457"
    assert report.section_of("attention") == "D6" and report.section_of("model") == "D2"
    assert report.section_of("ddp") == "D14" and report.section_of("warmup") == "D2"
    assert report.section_of("leaderboard") == "D12" and report.section_of(None) is None
    viewed_in = [s.key for s in report.SECTIONS if any(k == "model" for k, _ in s.views)]
    assert viewed_in == ["D4", "D7b"]
    assert report.device_capacity_bytes("NVIDIA H100 80GB HBM3") == 80 * 2**30


def test_compare_workflow_and_regression_gate(tmp_path: Path) -> None:
    """The compare commands of docs/comparing-runs.md: save a baseline, compare runs, fail on a regression."""
    storage = f"--benchmark-storage=file://{tmp_path}"
    select = ["-k", "sharding"]
    base = _pytest(*select, storage, "--benchmark-save=baseline")
    assert base.returncode == 0, base.stdout[-2000:]
    # 3,000x the Python work per step: tens of ms against well under 1 ms, whatever the machine's
    # load, so the gate on the minimum must trip (and the run is still saved, as 0002).
    slow = _pytest(
        *select,
        storage,
        "--benchmark-autosave",
        "--benchmark-compare=0001",
        "--benchmark-compare-fail=min:10%",
        work=3_000,
    )
    assert slow.returncode != 0
    assert "Performance has regressed" in slow.stdout + slow.stderr
    saved = sorted(p.name for p in tmp_path.rglob("*.json"))
    assert saved[0] == "0001_baseline.json" and saved[1].startswith("0002_")

    # The CLI loads the root conftest.py (it imports cs336_systems): it needs PYTHONPATH=src too.
    cli = [sys.executable, "-m", "pytest_benchmark", "--storage", f"file://{tmp_path}"]
    compare = subprocess.run(
        [*cli, "compare", "0001", "0002", "--group-by=group", "--columns=mean,stddev"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert compare.returncode == 0, compare.stderr[-2000:]
    assert (
        "benchmark 'D20 sharding': 4 tests" in compare.stdout and "test_sharding[sharded]" in compare.stdout
    )
    # The README's pairing: --group-by=name puts each case of both runs side by side.
    by_name = subprocess.run(
        [*cli, "compare", "0001", "0002", "--group-by=name", "--columns=mean,stddev"],
        env=_env(),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert by_name.returncode == 0 and "benchmark 'test_sharding[sharded]': 2 tests" in by_name.stdout
