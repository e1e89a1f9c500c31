"""The judging process's loop, in the package (``python -m cs336_systems.grading.judge``): an installed
grader needs no ``tests/`` folder, and ``repo_job`` runs this, not pytest.

One run: find the student's roots and read the adapters file's blank hooks (``probe``); check that it
loads (one worker; skipped when the parent already did, ``settings.loaded_before``); draw the seed;
select the cases (the table's order, by tier, edition and ``-k``, as ``tests/contract`` selects its
tests); plan every selected case's job (``session.Grader``) and judge them in order, each verdict
recorded (``summary.Recorder``: a progress line each, then ``grade.json``). Writing a report, this process
is a subreaper and kills whatever the graded code left before ``grade.json`` is written.

Exit status, as the pytest run it replaces: 0 passed, 1 a failure (grading another implementation: only
a course failure or a case that cannot be graded), 2 interrupted, 4 a usage error (one line: a file that
is not there or does not load, a ``-k`` that does not parse), 5 no case selected. ``pytest tests/contract``
stays a front end of the same pieces (its conftest builds the ``Grader``, its plugin the ``Recorder``).
"""

from __future__ import annotations

import sys
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from ..limits import Limits
from ..probe import Probe, probe
from ..roots import SUITE_ROOT, GradingSetupError, StudentRoots, discover
from ..sandbox import Sandbox, become_subreaper, kill_descendants
from ..settings import adapters_from_env, loaded_before, mark_loaded
from ..shared.cases import FAMILIES, Case, of_family
from ..verdict import ERROR, FAILED, GRADER_RAISED, PASSED, SKIPPED, Verdict
from . import keywords
from .session import Grader, check_loads, default_jobs, load_verdict, run_seed
from .summary import STATUSES, Recorder, case_entry, exit_status, render

OK, FAILURES, INTERRUPTED, USAGE_ERROR, NONE_SELECTED = 0, 1, 2, 4, 5
DEFAULT_ADAPTERS = SUITE_ROOT / "tests" / "adapters.py"  # the suite's own hooks, in a checkout
MARKS = {PASSED: ".", FAILED: "F", SKIPPED: "s", ERROR: "E"}


@dataclass(frozen=True)
class JudgeConfig:
    """One judging run; the fields are the options of ``options.OPTIONS`` (and ``-k``)."""

    adapters: Path | None = None  # None: CS336_ADAPTERS, else the suite's own tests/adapters.py
    repo_root: Path | None = None
    package_root: Path | None = None
    basics_root: Path | None = None
    grade_json: Path | None = None
    progress: Path | None = None
    seed: int | None = None
    tiers: str | None = None  # comma-separated; None: every tier
    jobs: int | None = None  # None: session.default_jobs()
    keyword: str | None = None  # pytest's -k expression on the cases (``keywords``)
    summary: bool = True  # print the hook x tier table at the end
    limits: Limits = field(
        default_factory=Limits
    )  # the repository's --timeout (``--grade-timeout``) and its workers' share

    def requested(self) -> Path | None:
        """The adapters file asked for (option, then environment); None grades the suite's own."""
        value = self.adapters or adapters_from_env()
        return Path(value).expanduser().resolve() if value else None


def tier_selected(tier: str, tiers: str | None) -> bool:
    return not tiers or tier in tiers.split(",")


@dataclass(frozen=True)
class Selection:
    cases: list[Case]
    deselected: int


def select(config: JudgeConfig, found: Probe, requested: bool) -> Selection:
    """The cases to judge, in the order ``tests/contract/test_hooks.py`` runs them: by tier, not the
    other edition's hooks (when a file was asked for: a 1.0.5 file has no ``get_fsdp``), and ``-k``.
    Deselected are the file's edition's cases that the tiers or ``-k`` leave out, not the other
    edition's, which the file cannot have."""
    wanted = keywords.matcher(config.keyword)
    table = [case for family in FAMILIES for case in of_family(family)]
    edition = [case for case in table if not (requested and found.absent(case.hooks))]
    chosen = [case for case in edition if tier_selected(case.tier, config.tiers) and wanted(case)]
    return Selection(chosen, len(edition) - len(chosen))


def isolation_here(grade_json: Path | None) -> dict | None:
    """Writing a report, this process is a subreaper (what the graded code leaves is re-parented here
    and killed before ``grade.json``); what isolation its workers get, for the report."""
    if grade_json is None:
        return None
    become_subreaper()
    return Sandbox.from_env().isolation()


@dataclass
class Prepared:
    roots: StudentRoots
    probe: Probe
    selection: Selection
    seed: int
    external: bool  # another implementation than the suite's own


def prepare(config: JudgeConfig) -> Prepared:
    """Everything decided before a case runs; ``GradingSetupError`` / ``KeywordError``: one line."""
    requested = config.requested()
    roots = discover(requested or DEFAULT_ADAPTERS, config.repo_root, config.package_root, config.basics_root)
    found = probe(roots.adapters)
    selection = select(config, found, requested is not None)
    # An import missing from the source is every case's verdict (``session.load_verdict``), found
    # without a worker: the load check would only say it again, as the grading's error.
    if requested is not None and not loaded_before(str(roots.adapters)) and load_verdict(roots) is None:
        check_loads(roots, config.limits)
        mark_loaded(str(roots.adapters))
    external = requested is not None and not roots.self_grade
    return Prepared(roots, found, selection, run_seed(config.seed), external)


@dataclass
class Judged:
    """What a run judged: each case's entry (``recorder``), the cases whose judging raised (their
    tracebacks), and whether it ran to the end (not interrupted)."""

    recorder: Recorder
    crashed: dict[str, str] = field(default_factory=dict)
    finished: bool = True


def _judge_one(grader: Grader, case: Case, judged: Judged) -> str:
    """Judge ``case`` and record it; its mark. A judging that raises is a bug of the grader: the case is
    recorded as one the grader could not grade (so the repository's results show a visible "grader
    failed" and keep the case's points in its maximum, rather than losing the case) and the run goes on."""
    try:
        verdict = grader.verdict(case)
    except Exception as exc:
        judged.crashed[case.id] = traceback.format_exc()
        verdict = Verdict.error(GRADER_RAISED, f"the grader raised {type(exc).__name__}: {exc}"[:2000])
    judged.recorder.add(case_entry(case, verdict, grader.worker_seconds(case.id)))
    if case.id in judged.crashed:
        return "F"
    return MARKS[verdict.status]


def judge_cases(grader: Grader, cases: list[Case], judged: Judged, said: Callable[[str], None]) -> None:
    """Judge ``cases`` in order (every job planned first), saying each one's mark as it comes."""
    grader.plan(cases)
    try:
        for case in cases:
            said(_judge_one(grader, case, judged))
    except KeyboardInterrupt:
        judged.finished = False
    finally:
        grader.close()


def status_of(judged: Judged, external: bool) -> int:
    """pytest's status (any failed or ungradable case fails), narrowed for another implementation."""
    if not judged.finished:
        return INTERRUPTED
    cases = judged.recorder.cases.values()
    bad = bool(judged.crashed) or any(c["status"] in (FAILED, ERROR) for c in cases)
    return exit_status(judged.recorder.report(), external, FAILURES if bad else OK)


def _failures(judged: Judged) -> list[str]:
    """Each failed or ungradable case with its message, as pytest's report listed them; cases that
    share one message (an import every case needs, a missing dependency) are one entry naming them."""
    alike: dict[tuple[str, str], list[str]] = {}  # (status, message) -> the case ids, in order
    for case in judged.recorder.cases.values():
        if case["status"] in (FAILED, ERROR) and case["id"] not in judged.crashed:
            alike.setdefault((case["status"], case["message"] or "(no message)"), []).append(case["id"])
    lines = []
    for (status, message), ids in alike.items():
        head, *rest = message.splitlines()
        named = ids[0] if len(ids) == 1 else f"{ids[0]} and {len(ids) - 1} more cases"
        lines.append(f"{status.upper()} {named}: {head}")
        lines += [f"    {line}" for line in rest]
    for case_id, trace in judged.crashed.items():
        lines += [f"CRASHED {case_id}: the grader raised", *trace.rstrip().splitlines()]
    return lines


def _totals(judged: Judged, deselected: int, seconds: float) -> str:
    counts = Counter(c["status"] for c in judged.recorder.cases.values())
    parts = [f"{counts[s]} {s}" for s in STATUSES if counts[s]]
    if deselected:
        parts.append(f"{deselected} deselected")
    return f"{', '.join(parts) or 'no case graded'} in {seconds:.2f}s"


def _report(out: TextIO, judged: Judged, selection: Selection, seconds: float, table: bool) -> None:
    print(file=out)  # ends the line of marks
    for line in [*_failures(judged), _totals(judged, selection.deselected, seconds)]:
        print(line, file=out)
    if table and judged.recorder.cases:
        print("grading summary: hook x tier (passed/failed/skipped)", file=out)
        print(*render(judged.recorder.report()), sep="\n", file=out)


def _reap(isolation: dict | None) -> None:
    """Kill what the graded code left (the load check's worker may have), when this is a subreaper."""
    if isolation is not None:
        kill_descendants()


def judge_selected(config: JudgeConfig, prepared: Prepared, isolation: dict | None, out: TextIO) -> Judged:
    """Judge the selected cases; the report is written however that ends, the leftovers killed first."""
    judged = Judged(Recorder(prepared.seed, str(prepared.roots.adapters), config.progress))
    jobs = max(1, config.jobs) if config.jobs is not None else default_jobs()
    grader = Grader(
        prepared.roots,
        prepared.probe,
        prepared.seed,
        config.limits.worker_s,
        jobs=jobs,
        progress=config.progress,
    )
    try:
        judge_cases(
            grader, prepared.selection.cases, judged, lambda m: print(m, end="", file=out, flush=True)
        )
    finally:
        judged.recorder.write(config.grade_json, isolation)
    return judged


def run(config: JudgeConfig, out: TextIO | None = None) -> int:
    """One judging run, as the pytest run it replaces: a mark per case as it is judged, the failures, a
    totals line, the table (``summary``); the report and progress lines to their files."""
    out = out or sys.stdout
    started = time.monotonic()
    # Before the load check's worker: what it leaves behind is re-parented here, and killed.
    isolation = isolation_here(config.grade_json)
    try:
        prepared = prepare(config)
    except (GradingSetupError, keywords.KeywordError) as exc:
        _reap(isolation)
        print(f"ERROR: {exc}", file=sys.stderr)
        return USAGE_ERROR
    if not prepared.selection.cases:
        _reap(isolation)
        print(f"no case selected: {prepared.selection.deselected} deselected", file=out)
        return NONE_SELECTED
    judged = judge_selected(config, prepared, isolation, out)
    _report(out, judged, prepared.selection, time.monotonic() - started, config.summary)
    return status_of(judged, prepared.external)
