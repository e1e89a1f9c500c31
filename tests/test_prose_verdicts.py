"""The writeup's prose gives each row the verdict its table gives (issue 57): D22's step times and D25's
hardware figures came from rows the tables marked ``unreliable [n]``. Synthetic rows only."""

from __future__ import annotations

from cs336_systems import report
from cs336_systems.report.answers.memory import d22b
from cs336_systems.report.parallelism import DEFAULT_C, DEFAULT_W, hardware, parallelism_answer

CPU = "cpu (x86_64, 2 cores)"
GPU = "NVIDIA H100 80GB HBM3"
LOADED = {"load_avg_1m": 7.8, "cpu_cores": 2.0, "rounds_spread": 0.18, "rounds_n": 10.0}
QUIET = {"load_avg_1m": 0.5, "cpu_cores": 2.0, "rounds_spread": 0.01, "rounds_n": 10.0}
WILD = {"rounds_spread": 0.4, "rounds_n": 10.0}


def _rec(key: str, name: str, desc: dict, values: dict, device: str = CPU) -> report.Record:
    return report.Record(f"{key} group", key, name, "s", device, "m", desc, values)


def _cells(records: list[report.Record]) -> str:
    (table,) = report.build_tables(records)
    return " ".join(table.long.astype(str).to_numpy().ravel())


def _ckpt(policy: str, values: dict, device: str = CPU) -> report.Record:
    desc = {"policy": policy, "size": "tiny", "ctx": 32, "batch": 4, "dtype": "fp32"}
    return _rec("checkpointing", f"test_checkpointing[{policy}]", desc, values, device)


def test_d22_quotes_no_step_time_its_table_marks() -> None:
    policies = ("none", "every:1", "every:2", "every:3", "every:4", "every:6", "every:8", "nested")
    loaded = [_ckpt(p, {"median_ms": 1706.0 + 10 * i, **LOADED}) for i, p in enumerate(policies)]
    text = d22b(loaded)
    assert "1,706" not in text and "1706" not in text and "none is a result" in text
    assert "8 marked `unreliable` (none, every:1, every:2" in text
    mixed = [_ckpt("none", {"median_ms": 831.1, **QUIET}), _ckpt("every:1", {"median_ms": 1706.0, **LOADED})]
    text = d22b(mixed)
    assert "step times: none 831.1 ms; not quoted" in text and "1 marked `unreliable` (every:1)" in text
    assert "1,706" not in text
    cells = _cells(mixed)  # the table gives the same verdict
    assert "831.1" in cells and "1,706" not in cells and "unreliable [1]" in cells


def test_d22_gives_the_nested_peak_but_not_a_step_time_its_table_marks() -> None:
    peaks = {"none": 75158.0, "every:1": 32705.0, "every:2": 33602.0}
    rows = [
        _ckpt(p, {"median_ms": 400.0 + i, "peak_memory_mib": m}, GPU)
        for i, (p, m) in enumerate(peaks.items())
    ]
    nested = _ckpt("nested", {"median_ms": 920.0, "peak_memory_mib": 32709.0, **WILD}, GPU)
    text = d22b([*rows, nested])
    assert "nested: 32,709 MiB" in text and "920" not in text
    calm = _ckpt("nested", {"median_ms": 920.0, "peak_memory_mib": 32709.0}, GPU)
    assert "nested: 32,709 MiB at 920 ms" in d22b([*rows, calm])


def test_d25_takes_no_hardware_figure_from_a_row_its_table_marks() -> None:
    gloo = _rec(
        "allreduce",
        "gloo",
        {"backend": "gloo", "world_size": 2},
        {"mean_ms": 5.0, "busbw_gbps": 1.7, **LOADED},
    )
    model = _rec("model", "m", {"dtype": "bf16"}, {"mean_ms": 3.0, "matmul_tflops": 0.79, **LOADED})
    hw = hardware([gloo, model])
    assert (hw.c, hw.w) == (DEFAULT_C, DEFAULT_W)
    text = parallelism_answer([gloo, model])
    assert "busbw of the D13" not in text and "the 1 D13 rows measuring it are not results" in text
    assert "the 1 model rows measuring it are not results" in text
    assert "unreliable [1]" in _cells([gloo]) and "1.7" not in _cells([gloo])  # the table's verdict
    assert "0.79" not in _cells([model])
    calm = [_rec(r.group_key, r.name, r.descriptors, {**r.values, **QUIET}) for r in (gloo, model)]
    assert (hardware(calm).c, hardware(calm).w) == (0.79e12, 1.7e9)


def test_d25_judges_raw_pytest_benchmark_rows_the_same_way() -> None:
    """``python -m cs336_systems.report.parallelism results.json`` reads raw rows, not Records."""
    extra = {"group_key": "allreduce", "device_name": CPU, "busbw_gbps": 1.7, "mean_ms": 5.0}
    raw = {"group": "D13 all-reduce", "name": "gloo", "params": {"backend": "gloo"}, "extra_info": extra}
    rate = {"group_key": "model", "device_name": CPU, "matmul_tflops": 0.79, "mean_ms": 3.0}
    matmul = {"group": "D2 model", "name": "m", "params": {"dtype": "bf16"}, "extra_info": rate}
    assert hardware([raw, matmul]).w == 1.7e9  # C and W of one machine
    loaded = {**raw, "extra_info": {**extra, **LOADED}}
    assert hardware([loaded, matmul]).w == DEFAULT_W
