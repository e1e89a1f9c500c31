"""The course's own tests beside the grader's course tier (``--course-tests``), as the class report and
the console show them: per repository and hook group, whether the two agree (``course_tests.agreement``
decides; ``grade.json`` keeps its ``"agreement"`` and ``"course_tests"``)."""

from __future__ import annotations

from ..probe import ALL_HOOKS

COURSE_TITLE = "The course's own tests beside the grader (--course-tests)"
COURSE_NOTE = (
    "Per hook group, whether the course's tests, run on the repository's adapters file, and the grader's "
    "course tier say the same: `agree (pass)`, `agree (fail)`, `agree (not implemented)` (the course's tests "
    "fail on its NotImplementedError); `DISAGREE` names what each said; `course tests skipped here`: the "
    "course's Triton tests skip without a GPU, where the grader runs the kernel under Triton's interpreter."
)


def course_table(repos: dict[str, dict]) -> tuple[list[str], list[list[str]]] | None:
    """Repositories x hook groups, each cell the agreement (``course_tests.agreement``); a repository
    whose course tests could not run says why; None when no repository ran them."""
    ran = {n: r["report"] for n, r in repos.items() if r["report"] and "course_tests" in r["report"]}
    if not ran:
        return None
    groups = [g for g in ALL_HOOKS if any(g in (rep.get("agreement") or {}) for rep in ran.values())]
    columns = groups or ["course tests"]
    rows = []
    for name, rep in ran.items():
        if why := rep.get("course_tests_error"):
            rows.append([name, f"not run: {why}", *["" for _ in columns[1:]]])
        else:
            rows.append([name, *[(rep.get("agreement") or {}).get(g, "—") for g in columns]])
    return ["repository", *columns], rows


def agreement_summary(report: dict | None) -> str:
    """One cell: how many hook groups agree with the course's tests, and the ones that do not."""
    if not report or "course_tests" not in report:
        return ""
    if why := report.get("course_tests_error"):
        return f"not run: {why}"
    said = report.get("agreement") or {}
    agree = sum(v.startswith("agree") for v in said.values())
    other = [f"{g}: {v}" for g, v in said.items() if not v.startswith("agree")]
    return "; ".join([f"{agree} of {len(said)} groups agree", *other])


def course_test_lines(report: dict) -> list[str]:
    """The console's lines of one repository's ``--course-tests``: a line per hook group."""
    if "course_tests" not in report:
        return []
    if why := report.get("course_tests_error"):
        return [f"course tests: not run: {why}"]
    return [f"course tests, {name}: {verdict}" for name, verdict in (report.get("agreement") or {}).items()]
