"""The contract between bench/ and the report (``rows/schema.py``): every group a bench emits is
declared, every declared group is emitted by some bench, every group the writeup routes is declared,
and no bench names a group with a string of its own. Bench files are read as text (collecting them
would import torch-heavy modules and GPU-only cases)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from cs336_systems.report import SECTIONS, Section, register_section
from cs336_systems.rows.schema import GROUPS, group, tag

BENCH = Path(__file__).resolve().parents[1] / "bench"


# Callables through which a bench names its group, and the position of the group key among their
# arguments: ``tag(benchmark, "key")`` and the training benches' ``run_train_case(benchmark, runs, "key", ...)``.
GROUP_NAMING_CALLS = {"tag": 1, "run_train_case": 2}


def _tag_keys(path: Path) -> set[str]:
    """The literal group keys of every schema-naming call in a bench file."""
    keys = set()
    for node in ast.walk(ast.parse(path.read_text())):
        position = (
            GROUP_NAMING_CALLS.get(getattr(node.func, "id", None)) if isinstance(node, ast.Call) else None
        )
        if position is not None and len(node.args) > position:
            arg = node.args[position]
            assert isinstance(arg, ast.Constant), (
                f"{path.name}:{node.lineno}: the group key must be a literal"
            )
            keys.add(arg.value)
    return keys


def _own_group_strings(path: Path) -> list[str]:
    """Places where a bench names its group itself: ``benchmark(group=...)`` or ``x.group = ...``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and any(k.arg == "group" for k in node.keywords):
            found.append(f"{path.name}:{node.lineno}")
        if isinstance(node, ast.Assign) and any(getattr(t, "attr", None) == "group" for t in node.targets):
            found.append(f"{path.name}:{node.lineno}")
    return found


BENCH_FILES = sorted(BENCH.glob("bench_*.py"))


def test_bench_groups_match_the_schema() -> None:
    emitted = {key: [p.name for p in BENCH_FILES if key in _tag_keys(p)] for key in GROUPS}
    undeclared = {k for p in BENCH_FILES for k in _tag_keys(p)} - set(GROUPS)
    assert not undeclared, f"benches emit groups rows/schema.py does not declare: {sorted(undeclared)}"
    unused = sorted(k for k, files in emitted.items() if not files)
    assert not unused, f"rows/schema.py declares groups no bench emits: {unused}"


def test_benches_name_groups_only_through_the_schema() -> None:
    own = [place for p in BENCH_FILES for place in _own_group_strings(p)]
    assert not own, f"group names written by hand instead of schema.tag(): {own}"


def test_writeup_routes_only_declared_groups() -> None:
    routed = {k for s in SECTIONS for k in (*s.groups, *(k for k, _ in s.views))}
    assert routed <= set(GROUPS)
    with pytest.raises(KeyError, match="not declared"):
        Section("Dx", "t", "a", "b", groups=("no_such_group",))


def test_register_section_places_and_replaces() -> None:
    before = list(SECTIONS)
    try:
        register_section(Section("D12b", "extra", "asks", "bench", groups=("leaderboard",)), after="D12")
        keys = [s.key for s in SECTIONS]
        assert keys[keys.index("D12") + 1] == "D12b"
        register_section(Section("D12b", "again", "asks", "bench"))
        assert [s.key for s in SECTIONS] == keys and SECTIONS[keys.index("D12b")].title == "again"
    finally:
        SECTIONS[:] = before


def test_tag_writes_the_routing_fields() -> None:
    from types import SimpleNamespace

    bench = SimpleNamespace(group=None, extra_info={})
    tag(bench, "ddp", "xl")
    assert bench.group == "D14-D17 DDP xl"
    assert bench.extra_info == {"group_key": "ddp", "deliverable": "D14-D17"}
    with pytest.raises(KeyError, match=r"declare it in rows/schema\.py"):
        group("nosuch")


def test_section_modules_are_imported_when_the_writeup_is_built(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cs336_systems.report import writeup

    (tmp_path / "extra_section_for_test.py").write_text(
        "def register(writeup):\n"
        '    writeup.register_section(writeup.Section("D99", "Extra (D99)", "asked", "bench", '
        'groups=("fsdp",), answer=lambda records: f"{len(records)} rows seen", always=True))\n'
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(writeup, "SECTION_MODULES", ["extra_section_for_test"])
    before = list(SECTIONS)
    try:
        text = writeup.build_writeup([], [], {}, tmp_path)
        assert "## Extra (D99)" in text and "0 rows seen" in text
    finally:
        SECTIONS[:] = before
