"""What a new user feeds the report (issue 18, frictions 1, 6, 7, 8 and 12): the benchmark CLI's own
``--json`` rows, malformed files (a one-line error, exit 2, nothing written), labels that must not
mislead, plots of one x value, two runs compared row by row, and the README's entry points."""

from __future__ import annotations

import configparser
import copy
import importlib.util
import json
import re
from pathlib import Path

import pytest

from cs336_systems import report
from cs336_systems.cli import benchmark as cli
from cs336_systems.harness.distributed import backend_device_name
from cs336_systems.harness.environment import environment_info
from cs336_systems.report.compare import compare_runs
from cs336_systems.report.plots import line_figure

from .test_report import _table, records, sample_json  # noqa: F401  (shared fixtures)

ROOT = Path(__file__).resolve().parents[1]


# -- friction 1: the report reads the CLI's --json ----------------------------------------------------


def test_report_reads_the_benchmark_cli_json(tmp_path: Path) -> None:
    rows = tmp_path / "cli.json"
    args = ["--size", "tiny", "--context", "16", "--batch", "2", "--mode", "fwd", "--warmup", "0"]
    assert cli.main([*args, "--steps", "1", "--no-mfu", "--device", "cpu", "--json", str(rows)]) == 0
    _, loaded = report.load([rows])
    (row,) = loaded
    assert row.group_key == "model" and row.name == "tiny-ctx16-fp32-fwd-eager-b2"
    assert row.values["mean_ms"] > 0 and row.descriptors["mode"] == "fwd"
    out = tmp_path / "out"
    assert report.main([str(rows), "--out", str(out)]) == 0
    text = (out / "writeup.md").read_text()
    d2 = text.split("## 1.1.3", 1)[1].split("\n## ", 1)[0]
    assert "### D2/D4/D7b model tiny (CLI)" in d2 and "No rows for this part" not in d2


def test_report_reads_the_leaderboard_cli_json(tmp_path: Path) -> None:
    """``cli.leaderboard --json`` (the README's D12 headline file, issue 57): D12 leaderboard rows timed
    the course's way, in the order they ran (ours, cudnn, ours shows drift)."""
    rows = [
        {"impl": "ours", "mean_ms": 4.485},
        {"impl": "cudnn", "mean_ms": 4.563},
        {"impl": "ours", "mean_ms": 4.487},
    ]
    path = tmp_path / "lb.json"
    path.write_text(json.dumps({"gpu": "NVIDIA H100 80GB HBM3", "dkdv_forced": None, "rows": rows}))
    _, loaded = report.load([path])
    assert {r.group_key for r in loaded} == {"leaderboard"} and {r.device for r in loaded} == {
        "NVIDIA H100 80GB HBM3"
    }
    (table,) = report.build_tables(loaded)
    by_run = {
        row["run"]: (row["impl"], row["course do_bench mean (ms)"]) for row in table.long.to_dict("records")
    }
    assert by_run == {"1": ("ours", "4.485"), "2": ("cudnn", "4.563"), "3": ("ours", "4.487")}


# -- friction 7: bad input is a one-line error, exit 2, and nothing written -----------------------------

BAD_INPUTS = {
    "empty": ({"benchmarks": []}, "no benchmark rows"),
    "no stats": ({"benchmarks": [{"group": "g", "name": "n", "extra_info": {}}]}, "no 'stats'"),
    "text mean": ({"benchmarks": [{"group": "g", "name": "n", "stats": {"mean": "fast"}}]}, "not a number"),
    "dict": ({"benchmarks": {"a": {"stats": {"mean": 1.0}}}}, "must be a list"),
}


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_json_is_one_line_and_writes_nothing(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data, message = BAD_INPUTS[case]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    out = tmp_path / "out"
    assert report.main([str(path), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1 and message in err
    assert not out.exists()


def test_out_file_and_directory_as_json(
    sample_json: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    a_file = tmp_path / "taken"
    a_file.write_text("x")
    assert report.main([str(sample_json), "--out", str(a_file)]) == 2
    assert "is a file" in capsys.readouterr().err and a_file.read_text() == "x"
    out, empty = tmp_path / "out", tmp_path / "empty"
    empty.mkdir()  # a folder stands for the results under it (issue 51); none is a one-line error
    assert report.main([str(empty), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no benchmark rows in" in err and err.count("\n") == 1 and not out.exists()


# -- friction 8: labels and plots -------------------------------------------------------------------


def test_no_max_over_ranks_label_and_one_machine_name(
    records: list[report.Record],  # noqa: F811
    sample_json: Path,  # noqa: F811
    tmp_path: Path,
) -> None:
    allreduce = _table(records, "D13")
    assert "slowest step (ms)" in allreduce.long.columns
    assert not any("over ranks" in c for t in report.build_tables(records) for c in t.long.columns)
    # Every bench names the host the same way (the model benches used to say just "cpu").
    assert environment_info("cpu")["device_name"] == backend_device_name("gloo")
    # Older files mix "cpu" and "cpu (...)": the header lists one machine.
    data = json.loads(sample_json.read_text())
    mixed = copy.deepcopy(data)
    mixed["benchmarks"] = [b for b in mixed["benchmarks"] if not b["group"].startswith("misc")]
    mixed["benchmarks"][0]["extra_info"]["device_name"] = "cpu (x86_64, 2 cores)"
    path = tmp_path / "mixed.json"
    path.write_text(json.dumps(mixed))
    (run,), _ = report.load([path])
    assert run.devices == {"cpu (x86_64, 2 cores)"}


def test_plot_of_one_x_value_is_left_out_and_points_sit_on_plain_ticks() -> None:
    # one seq is no trend "vs sequence length": no panel (issue 51)
    assert (
        line_figure({"p": {"a": [(256.0, 1.525, False)], "b": [(256.0, 1.61, False)]}}, "seq", "ms", "t")
        is None
    )
    series = {"a": [(128.0, 1.525, False), (256.0, 1.61, True)], "b": [(256.0, 1.7, False)]}
    fig = line_figure({"p": series}, "seq", "ms", "t")
    ax = fig.axes[0]
    assert ax.lines[0].get_linestyle() == "-"
    single = [line for line in ax.lines if line.get_label() == "b"]
    assert single[0].get_linestyle() == "None" and single[0].get_marker() == "o"
    # the unreliable point is marked, once in the legend
    crosses = [line for line in ax.lines if line.get_marker() == "x"]
    assert len(crosses) == 1 and list(crosses[0].get_xdata()) == [256.0]
    assert "unreliable timing (see the table)" in [t.get_text() for t in fig.legends[0].get_texts()]
    fig.canvas.draw()
    labels = [t.get_text() for t in (*ax.get_yticklabels(), *ax.get_yticklabels(minor=True))]
    shown = [label for label in labels if label]
    assert shown and not any("times" in label or "×" in label or "^" in label for label in shown), shown
    assert [t.get_text() for t in ax.get_xticklabels()] == ["128", "256"]
    (x0, x1), (y0, y1) = ax.get_xlim(), ax.get_ylim()
    assert x0 < 128 and x1 > 256 and y0 < 1.525 and y1 > 1.7  # every point inside the frame


# -- friction 12: compare two runs row by row ----------------------------------------------------------


def test_compare_pairs_rows_and_shows_the_ratio(
    sample_json: Path,  # noqa: F811
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    data = json.loads(sample_json.read_text())
    for bench in data["benchmarks"]:  # rounds within 1%: twice the time is outside their noise
        if "mean_ms" in bench["extra_info"]:
            bench["extra_info"]["std_ms"] = 0.01 * bench["extra_info"]["mean_ms"]
    base = tmp_path / "base.json"
    base.write_text(json.dumps(data))
    slower = copy.deepcopy(data)
    for bench in slower["benchmarks"]:
        if "mean_ms" in bench["extra_info"]:
            bench["extra_info"]["mean_ms"] *= 2
    slower["benchmarks"] = slower["benchmarks"][1:]  # one row only in A
    path = tmp_path / "slower.json"
    path.write_text(json.dumps(slower))
    text = compare_runs(base, path)
    first = data["benchmarks"][1]
    line = next(line for line in text.splitlines() if f"| {first['name']} |" in line)
    assert line.rstrip().endswith("| 2× | no |")  # the rounds' mean ± std bands are apart
    assert f"{len(data['benchmarks']) - 1} paired rows" in text and "only in A: 1 rows" in text
    assert report.main(["--compare", str(base), str(path)]) == 0
    assert "| 2× |" in capsys.readouterr().out
    assert report.main(["--compare", str(sample_json)]) == 2


# -- friction 6 and the README's commands --------------------------------------------------------------


def test_readme_entry_points_exist_and_name_the_cli_python() -> None:
    readme = (ROOT / "README.md").read_text()
    modules = set(re.findall(r"python3? -m (cs336_systems[\w.]*)", readme))
    assert {"cs336_systems.cli.benchmark", "cs336_systems.report"} <= modules
    for module in modules:
        assert importlib.util.find_spec(module) is not None, module
    assert ".tox/bench/bin/python -m cs336_systems.cli.benchmark" in readme and "tox -e cli" in readme
    tox = configparser.ConfigParser(interpolation=None)
    tox.read(ROOT / "tox.ini")
    assert "cs336_systems.cli.benchmark" in tox["testenv:cli"]["commands"]
    assert "--compare" in readme and "--group-by=name" in readme


def test_every_results_file_the_readme_rebuilds_from_loads() -> None:
    # docs/results/README.md rebuilds the writeup from `docs/results/*.json`: each must be a results file
    # the report reads (other JSON, such as compare_revisions.py's, lives in a subfolder).
    from cs336_systems.report.load import read_results

    paths = sorted((Path(__file__).parents[1] / "docs" / "results").glob("*.json"))
    assert paths
    for path in paths:
        assert read_results(path)["benchmarks"] is not None, path
