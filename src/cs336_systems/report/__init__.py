"""Benchmark results -> the writeup, one module per job (the group contract and the verdict on a row's
timing, shared with the harness, are ``cs336_systems.rows``):

- ``load``: pytest-benchmark JSON, the JSONL row log and the benchmark CLI's ``--json`` -> ``Record`` rows;
- ``tables``: cell formatting, the long table and the handout-shaped pivot of a group;
- ``render``: Markdown / LaTeX; ``plots``: figures; ``answers``: measured-vs-accounting prose;
- ``writeup``: the section registry, ``write_report`` and the CLI (``python -m cs336_systems.report``);
- ``compare``: two runs paired by row name.
"""

from cs336_systems.report.answers import device_capacity_bytes
from cs336_systems.report.load import Record, ReportInputError, Run, load
from cs336_systems.report.render import to_latex, to_markdown
from cs336_systems.report.tables import GroupTable, PivotSpec, build_tables, format_number, format_size
from cs336_systems.report.writeup import SECTIONS, Section, main, register_section, section_of, write_report
from cs336_systems.units import parse_size

__all__ = [
    "SECTIONS",
    "GroupTable",
    "PivotSpec",
    "Record",
    "ReportInputError",
    "Run",
    "Section",
    "build_tables",
    "device_capacity_bytes",
    "format_number",
    "format_size",
    "load",
    "main",
    "parse_size",
    "register_section",
    "section_of",
    "to_latex",
    "to_markdown",
    "write_report",
]
