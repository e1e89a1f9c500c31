"""The shipped tuning tables (kernels/flash/tune_table.py): a key in this GPU's table takes its config
without compiling or timing the other candidates; anything else is tuned as before."""

from __future__ import annotations

import json

import pytest
import torch
import triton

from cs336_systems.cli import flash_tune
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash.tune_table import (
    TABLES,
    TuneTable,
    read_table,
    stale_entries,
    table_path,
    triton_minor,
    write_table,
)

C = flash.TileConfig
KEY = flash.tune_key("fwd", 64, 512, 512, 64, True, torch.bfloat16)
OTHER = flash.tune_key("dq", 64, 512, 512, 64, True, torch.bfloat16)
CANDIDATES = [C(64, 64, 4, 4), C(64, 64, 4, 3), C(128, 64, 8, 3)]
META = {"device": "Test GPU", "triton": triton_minor()}


def test_table_path_is_the_device_name_as_a_file_name() -> None:
    assert table_path("NVIDIA H100 80GB HBM3").name == "NVIDIA_H100_80GB_HBM3.json"
    assert table_path("NVIDIA H200").parent == TABLES


def test_a_written_table_reads_back_and_merges(tmp_path) -> None:
    path = tmp_path / "t.json"
    write_table(path, {KEY: C(64, 64, 4, 3)}, META)
    write_table(path, {OTHER: C(128, 64, 8, 3)}, META)
    assert read_table(path).entries == {KEY: C(64, 64, 4, 3), OTHER: C(128, 64, 8, 3)}
    write_table(path, {KEY: C(64, 64, 4, 4)}, META)  # tuned again: replaced
    assert read_table(path).entries[KEY] == C(64, 64, 4, 4)
    write_table(path, {KEY: C(64, 64, 4, 4)}, {**META, "triton": "0.1"})  # another compiler: a new table
    assert set(json.loads(path.read_text())["keys"]) == {"fwd|bh64|q512|k512|d64|causal|bfloat16"}


def test_a_table_from_another_triton_or_none_is_not_used(tmp_path) -> None:
    path = tmp_path / "t.json"
    assert read_table(path).why_not == "no table for this device"
    write_table(path, {KEY: C(64, 64, 4, 3)}, {**META, "triton": "0.1"})
    table = read_table(path, triton_version=triton.__version__)
    assert not table.entries and "tuned with triton 0.1" in table.why_not


@pytest.fixture
def table_tuner():
    """A GPU-less tuner whose table holds ``KEY``."""
    table = TuneTable({KEY: C(64, 64, 4, 3)}, path="test")
    with flash.configured(autotune=True, tune_cache=None, tune_table=True):
        tuner = flash.Tuner(
            timer=lambda step: step() or 1.0,
            warm_up=lambda step: None,
            can_time=True,
            table=lambda: table,
        )
        yield tuner


def test_a_key_in_the_table_is_neither_built_nor_timed(table_tuner) -> None:
    tuner = table_tuner
    built: list[flash.TileConfig] = []
    assert tuner.choose("fwd", KEY, CANDIDATES, built.append) == C(64, 64, 4, 3)
    assert built == [], "a table hit compiled candidates"
    assert tuner.sources[KEY] == "table" and KEY not in tuner.timings
    assert tuner.report()["keys"]["fwd|bh64|q512|k512|d64|causal|bfloat16"]["source"] == "table"
    assert tuner.choose("dq", OTHER, CANDIDATES, built.append) in CANDIDATES
    assert built[: len(CANDIDATES)] == CANDIDATES and tuner.sources[OTHER] == "tuned", "a key not in it tunes"


def test_the_table_yields_to_stale_entries_and_to_settings(table_tuner) -> None:
    tuner = table_tuner
    built: list[flash.TileConfig] = []
    # An entry whose config is no longer a candidate is ignored: the key tunes.
    assert tuner.choose("fwd", KEY, [C(64, 64, 4, 4), C(128, 64, 8, 3)], built.append) in CANDIDATES
    assert built and tuner.sources[KEY] == "tuned"
    tuner.clear()
    with flash.configured(tune_table=False):
        built.clear()
        tuner.choose("fwd", KEY, CANDIDATES, built.append)
        assert built, "CS336_FLASH_TUNE_TABLE=0 still used the table"
    tuner.clear()
    with flash.configured(autotune=False):
        assert tuner.choose("fwd", KEY, CANDIDATES, built.append) == CANDIDATES[0], (
            "tuning off: first candidate"
        )


def test_every_shipped_table_names_current_candidates() -> None:
    # A candidate list change that drops a config some table chose is caught here, not silently ignored
    # on that GPU.
    tables = sorted(TABLES.glob("*.json"))
    assert tables, f"no tuning table in {TABLES}"
    for path in tables:
        data = json.loads(path.read_text())
        assert {"device", "triton", "command", "keys"} <= set(data), f"{path.name}: missing fields"
        assert table_path(data["device"]) == path, f"{path.name} is not named after its device"
        table = read_table(path, data["triton"])
        assert table.entries and stale_entries(table) == [], f"{path.name}: stale {stale_entries(table)}"


def test_flash_tune_needs_a_gpu_and_says_so(capsys) -> None:
    if torch.cuda.is_available() and not flash.INTERPRET:
        pytest.skip("this GPU could tune: the CPU refusal is what is tested")
    with pytest.raises(SystemExit):
        flash_tune.main(["--shapes", "model"])
    assert "needs a CUDA GPU" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        flash_tune.main(["--shapes", "grids"])
    assert "unknown shape sets ['grids']" in capsys.readouterr().err


@pytest.mark.gpu
def test_this_gpus_table_is_used_by_default(device) -> None:
    path = table_path(torch.cuda.get_device_name())
    if not path.exists():
        pytest.skip(f"no shipped table for {torch.cuda.get_device_name()} ({path.name})")
    table = read_table(path)
    assert table.entries, table.why_not
    key, cfg = next(iter(table.entries.items()))
    candidates = flash.tune_space(key[0], key[1:])[1]
    tuner = flash.Tuner()
    with flash.configured(autotune=True, tune_cache=None, tune_table=True):
        assert tuner.lookup(key, candidates) == cfg and tuner.sources[key] == "table"


def test_bench_rows_say_where_each_config_came_from() -> None:
    case = (64, 512, 512, 64, True, torch.bfloat16)
    flash.clear_tuning_cache()
    try:
        assert flash.config_sources(case) == {"fwd": "default", "dq": "default", "dkdv": "default"}
        key = flash.tune_space("dq", case)[0]
        flash.TUNER.cache[key], flash.TUNER.sources[key] = C(64, 64), "table"
        with flash.forced("fwd", C(32, 32)):
            assert flash.config_sources(case) == {"fwd": "forced", "dq": "table", "dkdv": "default"}
    finally:
        flash.clear_tuning_cache()


@pytest.mark.parametrize("name", ["NVIDIA FakeGPU 99GB", "NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3e"])
def test_a_gpu_without_its_own_table_gets_none(monkeypatch, name) -> None:
    """The device gate, on a device with no shipped table (issue 51: the only test of it ran on GPUs
    that have one): another GPU model's table, even a sibling H100's, must not be used."""
    from cs336_systems.kernels.flash import tune_table

    monkeypatch.setattr(tune_table, "INTERPRET", False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    tune_table.device_table.cache_clear()
    try:
        table = tune_table.device_table()
    finally:
        tune_table.device_table.cache_clear()
    assert table.entries == {} and table.why_not == "no table for this device"
    assert tune_table.table_for_device(name).entries == {}
    shipped = json.loads(next(TABLES.glob("*.json")).read_text())["device"]
    assert tune_table.table_for_device(shipped).path == str(table_path(shipped))
