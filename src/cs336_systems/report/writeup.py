"""The writeup: results files -> ``DIR/tables/``, ``DIR/plots/`` and ``DIR/writeup.md`` (D21), and the
``--compare`` mode that pairs the rows of two runs.

    python -m cs336_systems.report out.json [more.json ...] [--format md|latex] [--out DIR]
    python -m cs336_systems.report --compare before.json after.json

Several JSON files (one per GPU kind, say) are merged; every row keeps the device it ran on. Each
benchmark group becomes a table file (``.md`` or ``.tex``); ``writeup.md`` is Markdown whatever
``--format`` says. The writeup is a list of :class:`Section` s in :data:`SECTIONS`: each names the
schema group keys whose tables it shows (``rows/schema.py``: rows are routed on the
``extra_info["group_key"]`` that ``schema.tag`` writes, never on group names), further views of groups
shown elsewhere, and an ``answer(records) -> markdown`` for prose computed from code. Another module
adds its own section from a ``register(writeup)`` function that calls :func:`register_section`, and
is listed in :data:`SECTION_MODULES`; groups no section claims still appear at the end.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cs336_systems.report.answers.attention import d6_answer, flash_speedups, render_d5
from cs336_systems.report.answers.communication import d17_answer, d20_answer, render_d18
from cs336_systems.report.answers.memory import d22_answer, d24_answer
from cs336_systems.report.load import STATS_MEAN, Record, ReportInputError, Run, load, unreliable
from cs336_systems.report.plots import PLOTS
from cs336_systems.report.render import (
    footnote_lines,
    render_group_latex,
    render_group_markdown,
    to_markdown,
    withheld_line,
)
from cs336_systems.report.tables import GroupTable, PivotSpec, _not_run, build_tables
from cs336_systems.rows.contention import LOAD_PER_CORE
from cs336_systems.rows.schema import GROUPS


@dataclass(frozen=True)
class Section:
    """One part of the writeup. ``groups``: schema keys whose tables sit here; ``views``: (key, pivot)
    of groups whose own table sits in another section; ``answer``: Markdown computed from all rows
    (closed forms, fits, checks); ``always``: shown even with no rows (a pure closed-form answer)."""

    key: str
    title: str
    asks: str
    bench: str  # where the numbers come from
    groups: tuple[str, ...] = ()
    views: tuple[tuple[str, PivotSpec], ...] = ()
    answer: Callable[[list[Record]], str] | None = None
    always: bool = False

    def __post_init__(self) -> None:
        unknown = [k for k in (*self.groups, *(k for k, _ in self.views)) if k not in GROUPS]
        if unknown:
            raise KeyError(f"section {self.key}: group keys {unknown} are not declared in rows/schema.py")


# The model group's table sits in D2 (by mode); D4 and D7b show the same rows by precision / compile.
BY_DTYPE = PivotSpec((("dtype",),), ("mean_ms", STATS_MEAN))
BY_COMPILE = PivotSpec((("compile",),), ("mean_ms", STATS_MEAN))

_BUILTIN = (
    Section(
        "D2",
        "1.1.3 End-to-end benchmarking (benchmarking_script, D2)",
        "Forward and forward+backward time per Table 1 size (5 warm-ups, 10 timed steps, mean ± std), and "
        "the effect of 0 / 1 / 2 warm-up steps.",
        "bench/bench_model.py",
        groups=("model", "warmup"),
    ),
    Section(
        "D3",
        "1.1.4 Nsight Systems profile (nsys_profile, D3)",
        "Top kernels of forward and of training step, matmul share, softmax vs matmul inside attention.",
        "bench/bench_profile.py or `python -m cs336_systems.cli.benchmark --profile DIR`",
        groups=("profile",),
    ),
    Section(
        "D4",
        "1.1.5 Mixed precision (benchmarking_mixed_precision, D4)",
        "fp32 vs bf16 autocast timings per size.",
        "bench/bench_model.py",
        views=(("model", BY_DTYPE),),
    ),
    Section(
        "D5",
        "1.1.6 Memory profiling (memory_profiling, D5)",
        "Peak memory of the 2.7B model per context length, forward and full training step, fp32 and bf16; "
        "the residual-stream tensor size.",
        "bench/bench_model.py",
        groups=("memory",),
        answer=lambda records: render_d5(),
    ),
    Section(
        "D6",
        "1.2.1 PyTorch attention and torch.compile'd attention (pytorch_attention, torch_compile (a); D6, D7a)",
        "Timings of 100 forward and 100 backward passes, memory before backward, OOM cases, the memory "
        "accounting of the smallest OOM case.",
        "bench/bench_attention.py",
        groups=("attention",),
        answer=d6_answer,
    ),
    Section(
        "D7b",
        "Compiled whole model (torch_compile (b), D7b)",
        "Vanilla vs torch.compile'd Transformer: forward, and forward+backward+optimizer step.",
        "bench/bench_model.py",
        views=(("model", BY_COMPILE),),
    ),
    Section(
        "D11",
        "1.3.2 FlashAttention-2 benchmark (flash_benchmarking, D11)",
        "Forward, backward and end-to-end latencies of our Triton FlashAttention-2 vs PyTorch, batch 1, "
        "causal, seq 128..65536, d 16..128, bf16 and fp32 (triton.testing.do_bench).",
        "bench/bench_flash.py",
        groups=("flash_sweep",),
        answer=flash_speedups,
    ),
    Section(
        "D12",
        "1.3.3 Leaderboard case (D12)",
        "batch 1 × 16 heads, seq 16384, d_head 64, bf16, causal, forward+backward.",
        "bench/bench_flash.py",
        groups=("leaderboard", "attention_shapes"),
    ),
    Section(
        "D13",
        "2.1 All-reduce (distributed_communication_single_node, D13)",
        "All-reduce latency for gloo+CPU and nccl+GPU, 1 MB–1 GB, 2/4/6 processes.",
        "bench/bench_allreduce.py",
        groups=("allreduce",),
    ),
    Section(
        "D14",
        "2.2–2.3 DDP variants (naive, flat, overlapped, bucketed; D14–D17)",
        "Time per training step and time communicating gradients, xl, 2 GPUs; bucket sizes 1–1000 MB; the "
        "overhead model of 2.3.3(b).",
        "bench/bench_ddp.py",
        groups=("ddp",),
        answer=d17_answer,
    ),
    Section(
        "D18",
        "2.4 Communication accounting (communication_accounting, D18)",
        "The XXL model: memory, FSDP shards on TPU v5p, compute-bound batch, and how to shrink the batch.",
        "closed form (cs336_systems.accounting)",
        answer=lambda records: render_d18(),
        always=True,
    ),
    Section(
        "D20",
        "3 Optimizer state sharding (optimizer_state_sharding_accounting, D20)",
        "Peak memory after init / before / after the step with and without sharding, time per step, and "
        "how our sharding differs from ZeRO stage 1.",
        "bench/bench_sharding.py",
        groups=("sharding",),
        answer=d20_answer,
    ),
    # The 2026 parts: tables routed here now; their owners replace a section (same key) through
    # SECTION_MODULES to add the closed-form answers and plots.
    Section(
        "D22",
        "2026: activation checkpointing (D22)",
        "Peak memory and step time with and without activation checkpointing.",
        "bench/bench_memory.py",
        groups=("checkpointing",),
        answer=d22_answer,
        always=True,
    ),
    Section(
        "D24",
        "2026: FSDP (D23, D24)",
        "FSDP step time and memory per rank next to torch's fully_shard; the memory accounting.",
        "bench/bench_fsdp.py",
        groups=("fsdp",),
        answer=d24_answer,
        always=True,
    ),
    Section(
        "D26",
        "2026: the 8B training step and its kernels (D26)",
        "Fused LM-head cross-entropy and fused AdamW against torch, the leaderboard step and its ablation.",
        "bench/bench_memory.py and the 2026 leaderboard bench",
        groups=("fused_loss", "fused_adamw", "leaderboard_2026", "leaderboard_2026_ablation"),
    ),
)


SECTIONS: list[Section] = list(_BUILTIN)

# Modules that contribute sections: each defines ``register(writeup)``, which calls
# ``writeup.register_section(...)`` (and may append to ``writeup.PLOTS``). They are imported and
# registered when a report is written, so they may import this module freely. Add yours here.
SECTION_MODULES: list[str] = ["cs336_systems.report.parallelism", "cs336_systems.report.proxy_8b"]


def register_section(section: Section, after: str | None = None) -> None:
    """Add a section to the writeup (after the section keyed ``after``, else at the end); a section
    with the same key is replaced, so re-importing the registering module is harmless."""
    keys = [s.key for s in SECTIONS]
    if section.key in keys:
        SECTIONS[keys.index(section.key)] = section
        return
    SECTIONS.insert(keys.index(after) + 1 if after in keys else len(SECTIONS), section)


def section_of(group_key: str | None) -> str | None:
    """The section whose table a group is."""
    return next((s.key for s in SECTIONS if group_key in s.groups), None)


def routed_group_keys() -> set[str]:
    """Every schema key some section shows (as its table or as a view)."""
    return {k for s in SECTIONS for k in (*s.groups, *(k for k, _ in s.views))}


def _runs_header(runs: list[Run]) -> list[str]:
    lines = [
        "# CS336 assignment 2 (systems): results",
        "",
        "Generated by `python -m cs336_systems.report` from benchmark JSON. Every table comes from "
        "the benches under `bench/`; closed-form answers come from `cs336_systems.accounting`. "
        "MFU is model FLOPs (matmuls only: ~6N per token plus attention; recomputation not counted) "
        "over the dense matmul rate measured in the same run, and, where a column says so, over the "
        "GPU's dense bf16 peak (989 TFLOP/s for H100 SXM and H200). A cell marked `unreliable [n]` or "
        "`interpreted [n]` is a timing that is not a result (footnote [n] says why; "
        "`--show-unreliable` prints its figure); no ratio is derived from it, and the prose does not "
        "quote it. `timers disagree [n]` marks the host-timed figures (mean, median) of a do_bench row "
        "that are orders of magnitude off its do_bench median, which is the row's result.",
        "",
        "| JSON | date | commit | pytest-benchmark | devices |",
        "| --- | --- | --- | --- | --- |",
    ]
    for run in runs:
        devices = ", ".join(sorted(run.devices)) or run.machine
        lines.append(f"| `{run.path.name}` | {run.datetime} | {run.commit} | {run.version} | {devices} |")
    return [*lines, ""]


def _table_file(table: GroupTable, fmt: str) -> str:
    """Where ``write_report`` writes the group's own table, relative to the writeup."""
    return f"tables/{table.slug}.{'md' if fmt == 'md' else 'tex'}"


def _withheld_summary(tables: list[GroupTable]) -> list[str]:
    """One paragraph up front when the machine's load withheld timings: a loaded run's writeup was 114
    cells of ``unreliable [n]`` that said so one cell at a time (issue 73). Rows withheld for their own
    rounds (spread) are the footnotes' business: no rerun advice fits them all."""
    timed = [r for t in tables for r in t.records if not r.oom and _not_run(r) is None and r.values]
    loaded = [r for r in timed if "load average" in (unreliable(r) or "")]
    if not loaded:
        return []
    loads = sorted(r.values["load_avg_1m"] for r in loaded)
    cores = "/".join(sorted({f"{r.values['cpu_cores']:g}" for r in loaded}))
    span = f"{loads[0]:.3g}" + (f"–{loads[-1]:.3g}" if f"{loads[-1]:.3g}" != f"{loads[0]:.3g}" else "")
    return [
        f"**{len(loaded)} of the {len(timed)} rows that ran were timed on a busy machine** (load average "
        f"{span} on {cores} cores, above {LOAD_PER_CORE:g} per core, with rounds that did not agree): their "
        "timings measure the load, not the code, and are withheld (`unreliable [n]`; a table left with no "
        "timing says so in one line). For figures, rerun on a quiet machine (`OMP_NUM_THREADS=1 tox -e "
        "bench`); to read these, marked, add `--show-unreliable` to `python -m cs336_systems.report`.",
        "",
    ]


def _section_lines(
    section: Section, tables: list[GroupTable], records: list[Record], plots, out, fmt: str = "md"
) -> list[str]:
    own = [t for t in tables if t.group_key in section.groups]
    views = [(t, t.view(spec)) for key, spec in section.views for t in tables if t.group_key == key]
    views = [(t, v) for t, v in views if v is not None]
    extra = _answer(section, records)
    lines = [f"## {section.title}", "", f"_Asked:_ {section.asks}", ""]
    if not own and not views and not section.always:
        lines += [f"No rows for this part in the given JSON (bench: {section.bench}).", ""]
    lines += [render_group_markdown(t, fold_withheld=True, table_file=_table_file(t, fmt)) for t in own]
    for t, view in views:
        shown = withheld_line(t, _table_file(t, fmt)) if t.withheld else to_markdown(view)
        lines += [f"### {t.group}: {view.attrs['title']}", "", f"_{t.caption}_", "", shown, ""]
        lines += footnote_lines(t.footnotes)
        lines += [*t.absent, ""] if t.absent else []
    lines += [
        f"![{key}]({path.relative_to(out).as_posix()})" + "\n"
        for key, path in plots.items()
        if key == section.key
    ]
    if extra:
        lines += [extra, ""]
    return lines


NEEDS_TORCH = (
    "_The closed-form part of this answer counts the model's parameters with torch, which this Python "
    "lacks; the report's tables need only pandas and tabulate. Run it with the bench environment's "
    "interpreter (`.tox/bench/bin/python`) to see it._"
)


def _needs_torch(exc: ModuleNotFoundError) -> bool:
    return (exc.name or "").split(".")[0] == "torch"


def _answer(section: Section, records: list[Record]) -> str:
    """The section's computed answer; without torch, a note in place of its closed forms."""
    if section.answer is None:
        return ""
    try:
        return section.answer(records)
    except ModuleNotFoundError as exc:
        if not _needs_torch(exc):
            raise
        return NEEDS_TORCH


def load_section_modules() -> list[str]:
    """Import every module of SECTION_MODULES and call its ``register(writeup)`` (idempotent); returns
    the modules left out because they need torch and this Python has none."""
    this = sys.modules[__name__]
    skipped = []
    for name in SECTION_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if not _needs_torch(exc):
                raise
            skipped.append(name)
            continue
        module.register(this)
    return skipped


def build_writeup(
    runs: list[Run], tables: list[GroupTable], plots: dict[str, Path], out: Path, fmt: str = "md"
) -> str:
    skipped = load_section_modules()
    records = [r for t in tables for r in t.records]
    lines = _runs_header(runs) + _withheld_summary(tables)
    if skipped:
        lines += [
            f"_Sections of {', '.join(skipped)} are left out: they need torch, which this Python lacks._",
            "",
        ]
    for section in SECTIONS:
        lines += _section_lines(section, tables, records, plots, out, fmt)
    others = [t for t in tables if section_of(t.group_key) is None]
    if others:
        lines += ["## Other benchmark groups", ""]
        lines += [
            render_group_markdown(t, fold_withheld=True, table_file=_table_file(t, fmt)) for t in others
        ]
    return "\n".join(lines).rstrip() + "\n"


def write_report(
    paths: Sequence[str | Path], out: str | Path, fmt: str = "md", show_unreliable: bool = False
) -> dict[str, Any]:
    """Read the results files and write tables, plots and writeup.md under ``out``; returns what it
    wrote. Input errors (ReportInputError) are raised before anything is written. ``show_unreliable``:
    cells of rows whose timing is not a result show their figures beside the mark."""
    if fmt not in ("md", "latex"):
        raise ValueError(f"format must be 'md' or 'latex', got {fmt!r}")
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ReportInputError(f"--out {out} is a file; give a directory")
    left_out: list[str] = []
    runs, records = load(paths, skipped=left_out)
    load_section_modules()  # before the plots: a contributed section may add one
    tables = build_tables(records, show_unreliable)
    table_dir = out / "tables"
    table_dir.mkdir(parents=True, exist_ok=True)
    written_tables = []
    for t in tables:
        path = table_dir / f"{t.slug}.{'md' if fmt == 'md' else 'tex'}"
        path.write_text(render_group_markdown(t) if fmt == "md" else render_group_latex(t))
        written_tables.append(path)
    plots = {}
    for section, name, plot in PLOTS:
        path = plot(records, out / "plots" / name)
        if path is not None:
            plots[section] = path
    writeup = out / "writeup.md"
    writeup.write_text(build_writeup(runs, tables, plots, out, fmt))
    return {
        "tables": written_tables,
        "plots": list(plots.values()),
        "writeup": writeup,
        "records": len(records),
        "left_out": left_out,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m cs336_systems.report",
        description="benchmark JSON (pytest-benchmark, its .jsonl row log, or the benchmark CLI's --json) "
        "-> tables, plots, writeup.md; or --compare two runs",
    )
    parser.add_argument(
        "json",
        nargs="+",
        help="results files (--benchmark-json output, .jsonl, CLI --json or --profile answers) or folders of them",
    )
    parser.add_argument(
        "--format", choices=("md", "latex"), default="md", help="table files format (default: md)"
    )
    parser.add_argument("--out", default="report", help="output directory (default: ./report)")
    parser.add_argument(
        "--compare", action="store_true", help="pair the rows of exactly two runs by name and print the ratio"
    )
    parser.add_argument(
        "--show-unreliable",
        action="store_true",
        help="print the figures of rows whose timing is not a result, beside their mark (default: the mark)",
    )
    args = parser.parse_args(argv)
    try:
        if args.compare:
            from cs336_systems.report.compare import compare_runs

            if len(args.json) != 2:
                raise ReportInputError(f"--compare takes exactly two JSON files, got {len(args.json)}")
            print(compare_runs(*args.json, show_unreliable=args.show_unreliable))
            return 0
        result = write_report(args.json, args.out, args.format, args.show_unreliable)
    except (ReportInputError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{result['records']} benchmark rows from {len(args.json)} path(s)")
    if result["left_out"]:  # found in folders, not given by name: not an error, but say which
        print(
            f"left out {len(result['left_out'])} file(s) that hold no results of this suite, e.g. {result['left_out'][0]}"
        )
    for path in [*result["tables"], *result["plots"], result["writeup"]]:
        print(f"wrote {path}")
    return 0
