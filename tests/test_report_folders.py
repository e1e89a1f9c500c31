"""The report reads folders (issue 51): the README's "Results" command names ``docs/results`` folders,
and D3's rows come from the benchmark CLI's ``--profile`` answers in a subfolder; the writeup keeps
every line under 1,000 characters whatever a kernel is called. Synthetic files: no bench runs here."""

from __future__ import annotations

import json
from pathlib import Path

from cs336_systems import report

KERNEL = "void at::native::elementwise_kernel<128, 2, " + "at::native::BinaryFunctor<float> " * 30 + ">"


def _bench_file(path: Path) -> Path:
    row = {
        "group": "D2 warm-up tiny",
        "name": "test_warmup[5]",
        "params": {"warmup": 5},
        "extra_info": {"group_key": "warmup", "device_name": "NVIDIA H100 80GB HBM3", "mean_ms": 12.0},
        "stats": {"mean": 0.012, "stddev": 0.0},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"benchmarks": [row], "datetime": "now", "version": "5"}))
    return path


def _results_folder(root: Path) -> Path:
    folder = root / "results"
    bench = _bench_file(folder / "h100-model.json")
    # the same run's row log beside it: the same rows, read once
    bench.with_suffix(".jsonl").write_text(json.dumps(json.loads(bench.read_text())["benchmarks"][0]) + "\n")
    profile = folder / "h200-profile" / "medium-ctx256-fp32-train-eager.d3.json"
    profile.parent.mkdir()
    answers = {"profile_device": "cuda", "forward_kernel_ms": 23.7, "forward_top_kernel": KERNEL}
    profile.write_text(json.dumps({**answers, "forward_top_other_kernels": [KERNEL, KERNEL, KERNEL]}))
    (folder / "compare-revisions").mkdir()
    (folder / "compare-revisions" / "h100-7059182-vs-tree.json").write_text(json.dumps({"rows": []}))
    (folder / "h200-profile" / "trace.json.gz").write_bytes(b"\x1f\x8b")
    return folder


def test_a_folder_is_read_recursively_and_d3_gets_the_profile_rows(tmp_path: Path, capsys) -> None:
    folder = _results_folder(tmp_path)
    out = tmp_path / "report"
    assert report.main([str(folder), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "2 benchmark rows from 1 path(s)" in printed
    assert "left out 1 file(s)" in printed and "h100-7059182-vs-tree.json" in printed
    text = (out / "writeup.md").read_text()
    d3 = text[text.index("(nsys_profile, D3)") : text.index("## 1.1.5")]
    assert "No rows" not in d3 and "23.70" in d3


def test_a_file_given_by_name_that_holds_no_results_is_still_an_error(tmp_path: Path, capsys) -> None:
    folder = _results_folder(tmp_path)
    assert (
        report.main(
            [str(folder / "compare-revisions" / "h100-7059182-vs-tree.json"), "--out", str(tmp_path / "r")]
        )
        == 2
    )
    assert "h100-7059182-vs-tree.json" in capsys.readouterr().err


def test_no_writeup_line_is_over_1000_characters(tmp_path: Path) -> None:
    out = tmp_path / "report"
    report.write_report([_results_folder(tmp_path)], out)
    lines = (out / "writeup.md").read_text().splitlines()
    longest = max(lines, key=len)
    assert len(longest) <= 1000, longest[:120]


def test_a_table_wider_than_a_line_is_split_under_its_case_columns() -> None:
    """Results files of one group merged bring their own columns (the 8B step's table reached 1,250
    characters a row): the table is shown in parts, each with the case columns."""
    import pandas as pd

    from cs336_systems.report.render import MAX_LINE, fitting, to_markdown

    frame = pd.DataFrame([{"case": f"c{i}", **{f"value {j}": "x" * 40 for j in range(40)}} for i in range(3)])
    parts = fitting(frame, 1)
    assert len(parts) > 1 and all(part.columns[0] == "case" for part in parts)
    assert [c for part in parts for c in list(part.columns)[1:]] == list(frame.columns)[1:]
    assert all(len(line) <= MAX_LINE for part in parts for line in to_markdown(part).splitlines())
    assert len(fitting(frame.iloc[:, :5], 1)) == 1  # a table that fits stays whole
