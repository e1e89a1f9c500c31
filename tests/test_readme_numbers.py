"""The README's headline numbers are the measured ones (issue 51: "5.551 s", "4.96 ms" and ranges that
no results file held). Each headline bullet cites the ``docs/results`` file it quotes; every decimal
number in the bullet (outside commands and paths) must be a value of that file, within its rounding.
Percentages may be a stored fraction (MFU 0.574 -> 57.4%) or a stored TFLOP/s over the dense bf16 peak
the bullet names. Also: the README's "Results" command fills D3 from the profile folder it names and
reports every row of each file a headline cites."""

from __future__ import annotations

import json
import re
from pathlib import Path

from cs336_systems.profiling.flops import DENSE_BF16_PEAK_TFLOPS

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*\.\d+)(%|×)?")
PEAKS = sorted(set(DENSE_BF16_PEAK_TFLOPS.values()))


def headlines(text: str) -> list[str]:
    """The bullets of the README's "### Headlines" section, each joined into one line."""
    section = text.split("### Headlines", 1)[1].split("\n## ", 1)[0]
    bullets = re.split(r"\n- ", "\n" + section.split("\n- ", 1)[1])
    return [" ".join(b.split()) for b in bullets if b.strip()]


def _values(path: Path) -> list[float]:
    """Every number a results file holds (pytest-benchmark JSON: extra_info and stats of each row; a
    CLI's JSON: its rows)."""
    out: list[float] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
        elif isinstance(node, int | float) and not isinstance(node, bool):
            out.append(float(node))

    data = json.loads(path.read_text())
    walk(data.get("benchmarks", data.get("rows")))
    return out


def _matches(text: str, unit: str | None, values: list[float]) -> bool:
    number = float(text.replace(",", ""))
    decimals = len(text.split(".")[1])
    candidates = list(values)
    if unit == "%":
        candidates = [100 * v for v in values] + [100 * v / p for v in values for p in PEAKS]
    return any(round(c, decimals) == number for c in candidates)


def checked_numbers(bullet: str) -> list[tuple[str, str | None]]:
    prose = re.sub(r"`[^`]*`", " ", bullet)  # commands and paths are not results
    prose = re.sub(r"\d{4}-\d{2}-\d{2}", " ", prose)  # dates
    return [(m.group(1), m.group(2)) for m in NUMBER.finditer(prose)]


def test_every_headline_cites_a_results_file_holding_its_numbers() -> None:
    bullets = headlines(README.read_text())
    assert len(bullets) >= 3
    for bullet in bullets:
        cited = re.findall(r"`(docs/results/[^`]+\.json)`", bullet)
        assert cited, f"a headline without its results file: {bullet[:80]}"
        assert re.search(r"\d{4}-\d{2}-\d{2}", bullet) and re.search(r"H100|H200", bullet), bullet[:80]
        values = [v for path in cited for v in _values(ROOT / path)]
        numbers = checked_numbers(bullet)
        assert numbers, bullet[:80]
        missing = [n for n, unit in numbers if not _matches(n, unit, values)]
        assert not missing, f"{missing} are in no cited file ({', '.join(cited)}): {bullet[:80]}"


def test_a_changed_number_fails_the_check() -> None:
    bullet = headlines(README.read_text())[0]
    path = re.findall(r"`(docs/results/[^`]+\.json)`", bullet)[0]
    values = _values(ROOT / path)
    number, unit = checked_numbers(bullet)[0]
    changed = f"{float(number.replace(',', '')) + 0.011:.{len(number.split('.')[1])}f}"
    assert _matches(number, unit, values) and not _matches(changed, unit, values)


def test_the_results_command_fills_d3(readme_report: Path) -> None:
    text = (readme_report / "writeup.md").read_text()
    d3 = text[text.index("(nsys_profile, D3)") : text.index("## 1.1.5")]
    assert "No rows" not in d3
    assert max(len(line) for line in text.splitlines()) <= 1000  # the GPU writeup too (issue 51: 1,093)


def test_the_results_command_reports_every_headline_files_rows(readme_report: Path) -> None:
    """The README's Results command reads the files its headlines cite (issue 57: it named the top level
    of docs/results only, so 5.257, 4.485 and 94.398 were in no table): each cited file is read, and each
    of its rows' figures, as the report formats them, is in the generated table of its group."""
    from cs336_systems import report
    from cs336_systems.report.load import MISSING

    writeup = (readme_report / "writeup.md").read_text()
    cited = sorted(
        {c for b in headlines(README.read_text()) for c in re.findall(r"`(docs/results/[^`]+\.json)`", b)}
    )
    assert len(cited) >= 5
    for path in cited:
        assert f"| `{Path(path).name}` |" in writeup, f"the Results command does not read {path}"
        _, records = report.load([ROOT / path])
        for table in report.build_tables(records):
            generated = (readme_report / "tables" / f"{table.slug}.md").read_text()
            figures = table.long.iloc[:, table.index_columns :].astype(str)
            for row in figures.to_dict("records"):
                cells = {re.sub(r" \[\d+\]$", "", cell) for cell in row.values()} - {MISSING}
                missing = sorted(c for c in cells if c not in generated)
                assert not missing, f"{path}: {missing} are not in the report's tables/{table.slug}.md"


def _section(text: str, title: str) -> str:
    return text.split(f"## {title}", 1)[1].split("\n## ", 1)[0]


def test_versions_sizes_and_times_are_stated_and_pinned() -> None:
    import configparser
    import tomllib

    text = README.read_text()
    bench = ("builds its environment the first time", "then runs for about 2.5 minutes at a load of 1.6–2.8")
    for fact in (
        "torch 2.13.0",
        "torch 2.11",
        "triton\n3.6.0",
        "1.8 GB",
        *bench,
        "10 to 11 minutes on 2 quiet cores",
    ):
        assert fact.replace("\n", " ") in " ".join(text.split()), fact
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    tox = configparser.ConfigParser()
    tox.read(ROOT / "tox.ini")
    assert "-r{toxinidir}/requirements/pins.txt" in tox["testenv"]["deps"].split()
    pins = (ROOT / "requirements" / "pins.txt").read_text().split()  # tox's pins, and the autograder's
    assert "triton==3.6.0; sys_platform == 'linux'" in deps and "triton==3.6.0" in pins
    torch_pin = next(d for d in deps if d.startswith("torch"))
    assert torch_pin.startswith("torch>=2.11") and "torch==2.13.0" in pins  # compat.py's range covers both


def test_each_command_names_its_python() -> None:
    text = README.read_text()
    for title in ("Results", "Comparing two runs"):
        commands = [ln for ln in _section(text, title).splitlines() if "-m cs336_systems" in ln]
        assert commands and all(".tox/bench/bin/python" in ln for ln in commands), title
    assert ".tox/bench/bin/pytest" in _section(text, "Comparing two runs")
    gpus = _section(text, "Running on GPUs")
    first_install = next(ln for ln in gpus.splitlines() if ln.startswith("pip install"))
    assert '".[test]"' in first_install and "--no-deps" not in first_install
    assert ".tox/bench/bin/python -m ..." in gpus  # the CLI on a CPU machine


def test_deliverable_numbers_are_explained_in_the_repository() -> None:
    deliverables = (ROOT / "docs" / "deliverables.md").read_text()
    assert all(f"| D{i} |" in deliverables for i in range(1, 27))
    for doc in (
        README,
        ROOT / "docs" / "architecture.md",
        deliverables and ROOT / "docs" / "deliverables.md",
    ):
        assert "SPEC.md" not in doc.read_text(), doc
    assert "docs/deliverables.md" in README.read_text()
