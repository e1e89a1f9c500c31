"""Reading benchmark results: pytest-benchmark JSON, its JSONL row log (``CS336_BENCH_JSONL``), the
``--json`` rows of ``python -m cs336_systems.cli.benchmark`` and ``cli.leaderboard`` and the benchmark
CLI's ``--profile`` answers, into :class:`Record` rows."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cs336_systems.rows.contention import (
    INTERPRETER_NOTE,
    cold_start,
    contention_reasons,
    host_timed,
    interpreted,
    scattered,
    verdict_label,
)
from cs336_systems.rows.schema import GROUPS


class ReportInputError(ValueError):
    """A results file the report cannot use; the message names the file and the problem (one line)."""


# Parameter-like keys, in the order they become index columns.
PARAM_ORDER = (
    "device",
    "source",
    "size",
    "ctx",
    "batch",
    "attention",
    "dtype",
    "compile",
    "mode",
    "impl",
    "variant",
    "backend",
    "world_size",
    "nbytes",
    "bucket_mb",
    "d",
    "seq",
    "pass_",
    "causal",
    "warmup",
)

# Value keys in the order they become columns, with their headers.
VALUE_LABELS = {
    "mean_ms": "mean ± std (ms)",
    "median_ms": "median (ms)",
    "do_bench_ms": "do_bench median (ms)",
    "graph_ms": "CUDA-graph replay (ms)",
    "launch_ms": "host issue (ms)",  # profiling.timing.launch_time: at least do_bench's, the row is host-bound
    "ratio_to_best_sdpa": "ours / best SDPA",
    "fwd_ms": "fwd (ms)",
    "bwd_ms": "bwd (ms)",
    "fwd_bwd_ms": "fwd+bwd (ms)",
    "max_ms": "slowest step (ms)",  # of the timed steps (per step, the max over ranks where ranks run)
    "first_ms": "first step (ms)",  # the first timed step: a cold start shows here (rows.contention)
    "tune_seconds_so_far": "autotuning so far (s)",  # bench_flash: this process's tuning, compiles included
    "comm_ms": "comm (ms)",
    "comm_share": "comm share",
    "overlap_share": "overlap",
    "tokens_per_s": "tokens/s",
    "model_flops": "model FLOPs",
    "tflops": "TFLOP/s",
    "mfu": "MFU (measured matmul rate)",
    "mfu_measured": "MFU (measured matmul rate)",  # the 8B step: 6N + causal attention FLOPs
    "mfu_peak": "MFU (dense bf16 peak)",  # profiling.flops.mfu_both: the two conventions, each named
    "course_mean_ms": "course do_bench mean (ms)",
    "algbw_gbps": "algbw (GB/s)",
    "busbw_gbps": "busbw (GB/s)",
    "peak_memory_mib": "peak mem (MiB)",
    "mem_before_bwd_mib": "mem before bwd (MiB)",
    "saved_for_bwd_mib": "saved for bwd (MiB)",
    "params_mib": "params (MiB)",
    "grads_mib": "grads (MiB)",
    "optim_state_mib": "optimizer state (MiB)",
    "peak_after_init_mib": "peak after init (MiB)",
    "peak_before_step_mib": "peak before step (MiB)",
    "peak_after_step_mib": "peak after step (MiB)",
}
STATS_MEAN = "stats_mean_ms"  # pytest-benchmark's own timing, used when extra_info has no mean_ms
VALUE_LABELS[STATS_MEAN] = "mean ± std (ms, pytest-benchmark)"
FRACTION_KEYS = {"mfu", "mfu_measured", "mfu_peak"}  # and every key with "share" in it
HOST_TIMER_KEYS = {
    "mean_ms",
    "median_ms",
    STATS_MEAN,
}  # pytest-benchmark's rounds: a do_bench row's second timer
CONTENTION_KEYS = {"load_avg_1m", "cpu_cores", "rounds_spread", "rounds_n"}  # judged, not shown as columns
NOT_VALUES = {"oom", "skipped", "device_name"}
MISSING = "—"


@dataclass
class Record:
    """One benchmark case of one JSON file."""

    group: str
    group_key: str | None  # the schema key (extra_info["group_key"], written by schema.tag)
    name: str
    source: str
    device: str  # extra_info device_name ("" until _mark_provenance fills it in)
    machine: str  # pytest-benchmark's machine_info of the file
    descriptors: dict[str, Any]  # parameters (and parameter-like extra_info) of the case
    values: dict[str, float]  # numeric extra_info (+ pytest-benchmark stats when nothing else)
    texts: dict[str, str] = field(default_factory=dict)  # string extra_info (kernel names, status...)
    flags: dict[str, bool] = field(default_factory=dict)  # boolean extra_info (fused_loss, compiled...)
    oom: bool = False
    skipped: str | None = None
    ratio_caveat: str | None = None  # a ratio on this row compares it with a row that is no result
    device_named: bool = True  # the row wrote its own device_name (``device`` may be filled in later)


@dataclass
class Run:
    """Top-level facts of one JSON file."""

    path: Path
    source: str
    datetime: str
    commit: str
    version: str
    machine: str
    devices: set[str] = field(default_factory=set)


def _std_key(key: str, extra: dict[str, Any]) -> str | None:
    """The extra_info key holding the standard deviation that goes with ``key`` (if any)."""
    if key == "mean_ms":
        candidates = ["std_ms"]
    elif key == STATS_MEAN:
        candidates = ["stats_std_ms"]
    elif key.endswith("_ms"):
        stem = key[: -len("_ms")]
        candidates = [f"{stem}_std_ms", f"{key}_std", f"std_{key}"]
    else:
        candidates = [f"{key}_std"]
    return next((c for c in candidates if c in extra), None)


def _machine_name(machine_info: dict[str, Any]) -> str:
    cpu = machine_info.get("cpu", {}) or {}
    brand = cpu.get("brand_raw") or machine_info.get("processor") or machine_info.get("machine") or "?"
    return f"{brand} ({machine_info.get('node', '?')})"


def _record(bench: dict[str, Any], source: str, machine: str) -> Record:
    params = dict(bench.get("params") or {})
    extra = dict(bench.get("extra_info") or {})
    # Parameters, and extra_info copies of parameter-like keys (dtype, batch...), index the rows.
    descriptors = dict(params)
    descriptors.update({k: v for k, v in extra.items() if k in PARAM_ORDER and k not in descriptors})
    values: dict[str, float] = {}
    texts: dict[str, str] = {}
    flags: dict[str, bool] = {}
    for key, value in extra.items():
        if key in descriptors or key in NOT_VALUES or key in ("group_key", "deliverable"):
            continue
        if isinstance(value, bool):  # judged (fused_loss: a Triton kernel ran), not shown as a column
            flags[key] = value
        elif isinstance(value, int | float):
            values[key] = float(value)
        elif isinstance(value, str):
            texts[key] = value
    oom = bool(extra.get("oom", False))
    skipped = extra.get("skipped")
    stats = bench.get("stats") or {}
    if not isinstance(stats, dict):
        raise ReportInputError(f"{source}: {bench.get('name', '?')}: 'stats' is not an object")
    mean = stats.get("mean")
    if mean is not None and (isinstance(mean, bool) or not isinstance(mean, int | float)):
        raise ReportInputError(f"{source}: {bench.get('name', '?')}: stats mean {mean!r} is not a number")
    if "mean_ms" in extra and not _is_number(extra["mean_ms"]) and extra["mean_ms"] is not None:
        raise ReportInputError(
            f"{source}: {bench.get('name', '?')}: extra_info mean_ms {extra['mean_ms']!r} is not a number"
        )
    if not stats and not values and not oom and not skipped and "status" not in extra:
        raise ReportInputError(f"{source}: {bench.get('name', '?')}: no 'stats' and no measured values")
    if "mean_ms" not in values and not oom and not skipped and mean is not None:
        values[STATS_MEAN] = mean * 1e3
        values["stats_std_ms"] = stats.get("stddev", 0.0) * 1e3
    group = bench.get("group") or "ungrouped"
    return Record(
        group=group,
        group_key=extra.get("group_key") or legacy_group_key(group),
        name=bench.get("name", "?"),
        source=source,
        device=str(extra.get("device_name") or ""),
        machine=machine,
        descriptors=descriptors,
        values=values,
        texts=texts,
        flags=flags,
        oom=oom,
        skipped=str(skipped) if skipped else None,
        device_named=bool(extra.get("device_name")),
    )


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and not math.isnan(value)


# Group names of results written before benches tagged their rows (docs/results/*.json): name
# pattern -> schema key, first match wins. New rows carry extra_info["group_key"] instead.
LEGACY_GROUPS: tuple[tuple[str, str], ...] = (
    (r"^D2\b.*warm", "warmup"),
    (r"^D2/D4/D7b|^D2\b", "model"),
    (r"^D3\b", "profile"),
    (r"^D5\b", "memory"),
    (r"^D6|^D7a", "attention"),
    (r"^D11\b", "flash_sweep"),
    (r"^D12\b.*leaderboard", "leaderboard"),
    (r"^D12\b", "attention_shapes"),
    (r"^D13\b", "allreduce"),
    (r"^D14", "ddp"),
    (r"^D20\b", "sharding"),
)


def legacy_group_key(group: str) -> str | None:
    """The schema key of a group name from before ``schema.tag`` (None: a group the schema lacks)."""
    return next((key for pattern, key in LEGACY_GROUPS if re.search(pattern, group)), None)


def _cli_rows(rows: list[Any], path: Path) -> dict[str, Any]:
    """``python -m cs336_systems.cli.benchmark --json`` writes a list of rows (``case`` plus the
    extra_info of the same ``run_case`` the model benches use): as benchmark entries of group "model"."""
    benchmarks = []
    for row in rows:
        if not isinstance(row, dict) or "case" not in row:
            raise ReportInputError(f"{path}: a list, but not the benchmark CLI's --json rows (no 'case')")
        extra = {k: v for k, v in row.items() if k != "case"}
        extra.setdefault("group_key", "model")
        name = GROUPS["model"].name(f"{row.get('size', '')} (CLI)")
        benchmarks.append({"group": name, "name": str(row["case"]), "params": {}, "extra_info": extra})
    return {"benchmarks": benchmarks}


PROFILE_SUFFIX = ".d3.json"  # the benchmark CLI's --profile answers (D3), one case per file


def _profile_rows(answers: dict[str, Any], path: Path) -> dict[str, Any]:
    """A ``--profile DIR`` answers file as one row of the D3 group (the bench's profile rows hold the
    same keys), so a results folder with the CLI's profiles fills D3 (issue 51: it said "No rows")."""
    extra = {k: "; ".join(map(str, v)) if isinstance(v, list) else v for k, v in answers.items()}
    extra.update(group_key="profile", device_name=str(answers.get("profile_device", "")))
    case = path.name[: -len(PROFILE_SUFFIX)]
    bench = {"group": GROUPS["profile"].name(case), "name": case, "params": {}, "extra_info": extra}
    return {"benchmarks": [bench]}


def _leaderboard_cli_rows(answers: dict[str, Any], path: Path) -> dict[str, Any]:
    """``python -m cs336_systems.cli.leaderboard --json`` (``{"gpu", "rows": [{"impl", "mean_ms", ...}]}``,
    the course's do_bench mean of each impl in the order run: ours, cudnn, ours shows drift) as rows of
    the D12 leaderboard group, so the README's D12 headline file is in the report (issue 57)."""
    benchmarks = []
    for run, row in enumerate(answers["rows"], 1):
        extra = {k: v for k, v in row.items() if k not in ("impl", "mean_ms")}
        extra.update(
            group_key="leaderboard", device_name=str(answers.get("gpu", "")), course_mean_ms=row["mean_ms"]
        )
        name = GROUPS["leaderboard"].name("course protocol (CLI)")
        params = {"impl": row["impl"], "run": run}
        benchmarks.append(
            {"group": name, "name": f"{row['impl']} #{run}", "params": params, "extra_info": extra}
        )
    return {"benchmarks": benchmarks}


def _is_leaderboard_cli(data: Any) -> bool:
    rows = data.get("rows") if isinstance(data, dict) else None
    return (
        bool(rows)
        and isinstance(rows, list)
        and all(isinstance(r, dict) and {"impl", "mean_ms"} <= set(r) for r in rows)
    )


def results_in(directory: Path) -> list[Path]:
    """The results files under ``directory``, recursively, in name order: pytest-benchmark JSON, row
    logs (``.jsonl``, unless the ``.json`` of the same run sits beside it: the same rows) and the
    CLI's ``--profile`` answers. Traces and memory snapshots (``.json.gz``, ``.pickle.gz``) are not results."""
    files = sorted(p for p in directory.rglob("*") if p.is_file() and p.suffix in (".json", ".jsonl"))
    return [p for p in files if not (p.suffix == ".jsonl" and p.with_suffix(".json").exists())]


def read_results(path: Path) -> dict[str, Any]:
    """One results file as pytest-benchmark's top-level object; a one-line ReportInputError otherwise."""
    if path.is_dir():
        raise ReportInputError(f"{path} is a directory, not a benchmark JSON file")
    try:
        text = path.read_text()
        # A .jsonl row log (CS336_BENCH_JSONL) holds one benchmark entry per line: what a sweep
        # had finished when its command was cut off.
        if path.suffix == ".jsonl":
            data: Any = {"benchmarks": [json.loads(line) for line in text.splitlines() if line.strip()]}
        else:
            data = json.loads(text)
    except FileNotFoundError:
        raise ReportInputError(f"no such benchmark JSON: {path}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ReportInputError(f"{path} is not valid JSON: {str(exc).splitlines()[0]}") from None
    if isinstance(data, list):
        data = _cli_rows(data, path)
    elif path.name.endswith(PROFILE_SUFFIX) and isinstance(data, dict) and "benchmarks" not in data:
        data = _profile_rows(data, path)
    elif _is_leaderboard_cli(data):
        data = _leaderboard_cli_rows(data, path)
    if not isinstance(data, dict) or "benchmarks" not in data:
        raise ReportInputError(
            f"{path} is neither pytest-benchmark JSON (no 'benchmarks' key) nor a CLI's --json rows"
        )
    if not isinstance(data["benchmarks"], list) or not all(isinstance(b, dict) for b in data["benchmarks"]):
        raise ReportInputError(f"{path}: 'benchmarks' must be a list of objects")
    return data


def _read_run(path: Path, source: str) -> tuple[Run, list[Record]]:
    """One results file: its run facts and rows; a one-line ReportInputError if it holds none of ours."""
    data = read_results(path)
    machine = _machine_name(data.get("machine_info") or {})
    commit = data.get("commit_info") or {}
    run = Run(
        path=path,
        source=source,
        datetime=str(data.get("datetime", "?")),
        commit=(str(commit.get("id") or "?")[:10] + (" (dirty)" if commit.get("dirty") else "")),
        version=str(data.get("version", "?")),
        machine=machine,
    )
    rows = [_record(bench, source, machine) for bench in data["benchmarks"]]
    if rows and all(r.group_key is None for r in rows):
        groups = sorted({r.group for r in rows})
        raise ReportInputError(
            f"{path} holds no rows of this suite: none of its {len(rows)} benchmarks is tagged by "
            f"cs336_systems.rows.schema (groups {', '.join(groups[:3])}{', ...' if len(groups) > 3 else ''})"
        )
    return run, rows


def load(paths: Sequence[str | Path], skipped: list[str] | None = None) -> tuple[list[Run], list[Record]]:
    """Read results files (pytest-benchmark JSON, a .jsonl row log, the CLI's --json rows or --profile
    answers); a file given by name that is none of them fails with its name in the message. A directory
    stands for the results files under it (``results_in``); those that are not results are left out,
    each named in ``skipped`` when given. No rows at all is an error too."""
    runs, records = [], []
    named = [Path(p) for p in paths]
    paths = [f for p in named for f in (results_in(p) if p.is_dir() else [p])]
    stems = [p.stem for p in paths]
    for path in paths:
        # The file stem names the source, unless two files share it (h100/model.json, h200/model.json).
        source = path.stem if stems.count(path.stem) == 1 else str(path)
        try:
            run, rows = _read_run(path, source)
        except ReportInputError as exc:
            if path in named:
                raise
            if skipped is not None:  # found in a folder: another tool's output, not an error of the user's
                skipped.append(str(exc))
            continue
        records += rows
        runs.append(run)
    if not records:
        raise ReportInputError(f"no benchmark rows in {', '.join(map(str, named))}: nothing to report")
    _mark_provenance(records)
    for run in runs:
        run.devices = {r.device for r in records if r.source == run.source}
    return runs, records


def _mark_provenance(records: list[Record]) -> None:
    """Make merged rows distinguishable: the device always, the source file when the same case on the
    same device comes from several files. A row without a device_name (an OOM or unsupported row, say)
    takes the one its file's group names elsewhere, else the machine of its file."""
    named: dict[tuple[str, str], set[str]] = {}
    for r in records:
        if r.device:
            named.setdefault((r.source, r.group), set()).add(r.device)
    for r in records:
        if not r.device:
            devices = named.get((r.source, r.group), set())
            r.device = next(iter(devices)) if len(devices) == 1 else r.machine
    # Older rows said just "cpu" where others of the same file say "cpu (x86_64, 2 cores)": one machine.
    for source in {r.source for r in records}:
        hosts = {r.device for r in records if r.source == source and r.device.startswith("cpu (")}
        if len(hosts) == 1:
            host = hosts.pop()
            for r in records:
                if r.source == source and r.device == "cpu":
                    r.device = host
    seen: dict[tuple[str, str, str], set[str]] = {}
    for r in records:
        seen.setdefault((r.group, r.name, r.device), set()).add(r.source)
    clash = any(len(sources) > 1 for sources in seen.values())
    for r in records:
        r.descriptors["device"] = r.device
        if clash:
            r.descriptors["source"] = r.source


def rows_of(records: Iterable[Record], *keys: str) -> list[Record]:
    """The rows of the schema groups ``keys`` (routing on extra_info["group_key"], never on names)."""
    return [r for r in records if r.group_key in keys]


def numeric(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _on_cpu(record: Record) -> bool:
    return record.device.lower().startswith("cpu")


def is_interpreted(record: Record) -> bool:
    """A Triton kernel timed under the interpreter (rows.contention.interpreted)."""
    return interpreted({**record.flags, **record.texts, **record.descriptors}, _on_cpu(record))


def unreliable(record: Record) -> str | None:
    """The one verdict on a row's timing: why it is not a result (a Triton kernel under the
    interpreter, or the machine's load: rows.contention), or None. Such a row is marked in the
    tables, ``--compare``, the plots and the prose, and no ratio is derived from it."""
    if is_interpreted(record):
        return INTERPRETER_NOTE
    device = record.device if record.device_named else ""
    reasons = contention_reasons(_facts(record), host_timed(device, record.values))
    return "; ".join(reasons) or None


def _facts(record: Record) -> dict[str, float]:
    """The values a verdict reads: the row's numbers, and its warm-up count, which the report reads as
    a parameter (the bench's terminal table sees it among the row's numbers)."""
    warmup = numeric(record.descriptors.get("warmup"))
    return {**record.values, **({"warmup": warmup} if warmup is not None else {})}


def figure_verdict(record: Record, key: str) -> str | None:
    """Why one figure of a row is no result: the row's verdict, else a ``mean ± std`` whose stddev is
    above its mean (rows.contention.scattered; a device-timed do_bench row's host-timed mean, a pass's
    own mean and stddev). A row measuring its cold start keeps its spread (rows.contention.cold_start)."""
    if why := unreliable(record):
        return why
    std = _std_key(key, record.values)
    if std is None or record.values.get("rounds_n") == 1 or cold_start(_facts(record)):
        return None
    return scattered(record.values.get(key), record.values.get(std))


def not_quoted(records: Sequence[Record], label: Callable[[Record], str] = lambda r: r.name) -> str:
    """What the prose says in place of the figures of rows whose timing is not a result (the rows it
    leaves out, each named by ``label``), with the mark their table cells carry: the prose quotes no
    figure its table marks ("" when every row is a result)."""
    marks: dict[str, list[str]] = {}
    for r in records:
        if why := unreliable(r):
            marks.setdefault(verdict_label(why), []).append(label(r))
    said = "; ".join(f"{len(names)} marked `{mark}` ({', '.join(names)})" for mark, names in marks.items())
    return (
        f"not quoted, as their timing is not a result (the table's footnotes say why): {said}" if said else ""
    )


def derived_from(*records: Record | None) -> str | None:
    """None when a figure derived from these rows (a ratio, a speed-up) may be printed; else one line
    saying which row's timing is not a result, to print in its place."""
    for r in records:
        if r is not None and (why := unreliable(r)):
            return f"not derived: {r.name}'s timing is not a result ({why})"
    return None
