"""Options and guards for the bench suite; fixtures shared with tests live in the root conftest.py.

Subset selection works on parameter names, the same for every bench file: ``--only size=small,xl
--only ctx=256`` keeps the cases whose parameter ``size`` is small or xl and whose ``ctx`` is 256
(cases without such a parameter are kept). A name or value that no collected case has is a usage
error that lists the valid ones. ``-k`` on the case ids works too.

Benches run serially: pytest-benchmark switches itself off under pytest-xdist (``-n``), so such a
run would pass without timing anything and write no JSON; it is refused instead.

Rows that were not timed (out of memory, unsupported, skipped: ``extra_info`` ``oom`` or ``skipped``,
the report's own test) stay in the JSON with their reason but are left out of pytest-benchmark's
terminal table, where their no-op timing would rank as the fastest baseline.
"""

from __future__ import annotations

import difflib
import os

import pytest

from cs336_systems.harness.adapters import MARKER as ADAPTERS_ROW
from cs336_systems.rows.contention import TIMERS_APART, row_verdict, timers_disagree, verdict_label

_UNTIMED = pytest.StashKey[int]()
_MARKED = pytest.StashKey[dict[str, int]]()
_NO_ADAPTERS = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("cs336 bench selection")
    group.addoption(
        "--only",
        action="append",
        default=[],
        metavar="PARAM=V1,V2",
        help="keep only cases whose parameter PARAM takes one of the values (repeatable)",
    )


def _benchmarking(config: pytest.Config) -> bool:
    """Whether this run would time benchmarks (pytest-benchmark's own options)."""
    if config.getoption("benchmark_skip", False):
        return False
    return not config.getoption("benchmark_disable", False) or config.getoption("benchmark_enable", False)


def _under_xdist(config: pytest.Config) -> bool:
    # The test pytest-benchmark applies before it disables itself.
    return config.getoption("dist", "no") != "no" or bool(os.environ.get("PYTEST_XDIST_WORKER"))


def pytest_configure(config: pytest.Config) -> None:
    if _under_xdist(config) and _benchmarking(config):
        n = config.getoption("numprocesses", None) or os.environ.get("PYTEST_XDIST_WORKER_COUNT", "N")
        raise pytest.UsageError(
            f"bench/ cannot run under pytest-xdist (-n {n}): pytest-benchmark switches itself off there, "
            "so nothing would be timed and no JSON written. Run the benches serially with -n 0, e.g. "
            "`pytest bench/ -n 0 --benchmark-json=out.json`, or add --benchmark-disable to run them "
            "untimed as smoke tests."
        )


def _parse_only(values: list[str]) -> dict[str, set[str]]:
    wanted: dict[str, set[str]] = {}
    for value in values:
        key, sep, choices = value.partition("=")
        if not sep or not choices:
            raise pytest.UsageError(f"--only expects PARAM=V1,V2, got {value!r}")
        wanted.setdefault(_public(key.strip()), set()).update(c.strip() for c in choices.split(","))
    return wanted


def _public(name: str) -> str:
    """A parameter's name as --only shows and takes it: ``pass_`` (a Python keyword dodged) is
    ``pass``; the spelling with the underscore is accepted too."""
    return name.rstrip("_") or name


def _params(item: pytest.Item) -> dict[str, object]:
    params = getattr(getattr(item, "callspec", None), "params", {})
    return {_public(k): v for k, v in params.items()}


def _sorted(values: set[str]) -> list[str]:
    return sorted(values, key=lambda v: (0, int(v), v) if v.lstrip("-").isdigit() else (1, 0, v))


def _only_errors(wanted: dict[str, set[str]], items: list[pytest.Item]) -> list[str]:
    """Every --only name or value that no collected case has, with the valid ones."""
    seen: dict[str, set[str]] = {}
    for item in items:
        for key, value in _params(item).items():
            seen.setdefault(key, set()).add(str(value))
    errors = []
    for key, values in wanted.items():
        if key not in seen:
            close = difflib.get_close_matches(key, seen, n=1) or [k for k in seen if k.lower() == key.lower()]
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            names = ", ".join(sorted(seen)) or "none: the collected cases are not parametrized"
            errors.append(
                f"--only {key}=...: no collected case has a parameter {key!r}{hint}; parameters: {names}"
            )
        elif unknown := values - seen[key]:
            errors.append(
                f"--only {key}=...: no collected case has {key} = {', '.join(_sorted(unknown))}; "
                f"{key} takes {', '.join(_sorted(seen[key]))}"
            )
    return errors


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # Runs before -k / -m deselection (pytest's own hook runs last), so names and values are
    # checked against every collected case.
    wanted = _parse_only(config.getoption("--only"))
    if not wanted:
        return
    errors = _only_errors(wanted, items)
    if errors:
        raise pytest.UsageError("\n".join(errors))
    keep, drop = [], []
    for item in items:
        params = _params(item)
        ok = all(str(params[k]) in v for k, v in wanted.items() if k in params)
        (keep if ok else drop).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def _untimed(bench: dict) -> bool:
    extra = bench.get("extra_info") or {}
    return bool(extra.get("oom") or extra.get("skipped"))


def _mark_verdicts(benchmarks: list[dict]) -> dict[str, int]:
    """The report's verdict in the terminal table too (issue 51): a row whose timing is not a result
    gets " (unreliable)" or " (interpreted)" after its name, a do_bench row whose host-timed rounds (these
    columns) are orders of magnitude off its result " (timers disagree)". These dicts are the table's own copies:
    the JSON, written before, keeps the names as they are."""
    marked: dict[str, int] = {}
    for b in benchmarks:
        extra = b.get("extra_info") or {}
        why = None if _untimed(b) else row_verdict(extra, b.get("params")) or timers_disagree(extra)
        if why:
            label = verdict_label(why)
            b["name"] = f"{b['name']} ({label})"
            marked[label] = marked.get(label, 0) + 1
    return marked


@pytest.hookimpl(wrapper=True, optionalhook=True)
def pytest_benchmark_group_stats(config: pytest.Config, benchmarks: list[dict], group_by: str):
    marked = _mark_verdicts(benchmarks)
    groups = yield
    if config is not None:  # None from the `pytest-benchmark compare` CLI
        config.stash[_UNTIMED] = sum(_untimed(b) for b in benchmarks)
        config.stash[_MARKED] = marked
    kept = [(name, [b for b in rows if not _untimed(b)]) for name, rows in groups]
    return [(name, rows) for name, rows in kept if rows]


def pytest_deselected(items: list[pytest.Item]) -> None:
    rows = sum(1 for i in items if i.get_closest_marker(ADAPTERS_ROW) is not None)
    if rows and items:
        config = items[0].config
        config.stash[_NO_ADAPTERS] = config.stash.get(_NO_ADAPTERS, 0) + rows


VERDICT_LINES = {
    "unreliable": "timed under contention (load average with rounds that disagree, or rounds spread over 25%)",
    "interpreted": "Triton kernels timed on a CPU, i.e. Triton's interpreter: not a performance figure",
    "timers disagree": f"these columns (host-timed rounds) are over {TIMERS_APART:g}x off the row's do_bench "
    "median, which is its result (extra_info do_bench_ms; the report's do_bench column)",
}


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    untimed = config.stash.get(_UNTIMED, 0)
    if untimed:
        terminalreporter.write_line(
            f"{untimed} row(s) not timed (OOM / unsupported / skipped) are left out of the benchmark "
            "table; the JSON keeps them with their reason."
        )
    for label, count in config.stash.get(_MARKED, {}).items():
        terminalreporter.write_line(
            f"{count} row(s) marked ({label}) in the benchmark table: {VERDICT_LINES[label]}; the "
            "report marks the same rows (--show-unreliable prints their figures)."
        )
    if no_adapters := config.stash.get(_NO_ADAPTERS, 0):
        terminalreporter.write_line(
            f"{no_adapters} case(s) deselected: the `adapters` rows, which time another implementation "
            "and run only with --adapters PATH."
        )
