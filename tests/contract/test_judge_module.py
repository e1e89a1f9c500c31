"""The judging process as a module of the package (``python -m cs336_systems.grading.judge``): ``-k``
selects the cases pytest's ``-k`` selects among the contract tests, an expression that does not parse is
one line and a usage error, and an installed package grades a repository with no ``tests/`` folder
anywhere near it, as the suite's checkout does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from _pytest.mark.expression import Expression

from cs336_systems.grading import gradescope
from cs336_systems.grading.judge import judging, keywords
from cs336_systems.grading.judge.summary import Recorder
from cs336_systems.grading.probe import probe
from cs336_systems.grading.shared.cases import CASES
from cs336_systems.grading.verdict import Verdict

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("suite_self_check")]
EXPRESSIONS = (
    "ddp",
    "pytorch and course",
    "attention and not leaderboard and not beyond",
    "optimizer",
    "distributed and not (ddp or FSDP)",
    "test_fsdp or b4-q128",
)
DQ_BUG = STUDENTS / "src_layout" / "tests" / "adapters_dq_bug.py"
# The course's case (passes) and one with n_queries != n_keys (its dQ is 1% off there: fails).
SELECTION = "pytorch and (course or q45-k83-d16-full-fp32) and cpu"


def _collected(expression: str) -> list[str]:
    """The case ids ``pytest tests/contract/test_hooks.py -k EXPRESSION`` collects, in order."""
    cmd = [sys.executable, "-m", "pytest", "tests/contract/test_hooks.py", "--collect-only", "-q"]
    cmd += ["-p", "no:cacheprovider", "-k", expression]
    run = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=120)
    ids = [line.partition("[")[2].rstrip("]") for line in run.stdout.splitlines() if "::test_" in line]
    assert ids, run.stdout[-2000:] + run.stderr[-2000:]
    return ids


@pytest.mark.parametrize("expression", EXPRESSIONS)
def test_k_selects_the_cases_pytest_selects(expression: str) -> None:
    config = judging.JudgeConfig(keyword=expression)
    chosen = judging.select(config, probe(ROOT / "tests" / "adapters.py"), requested=False).cases
    assert [c.id for c in chosen] == _collected(expression)


def test_the_expression_grammar_is_pytests() -> None:
    """Each expression, on each case's names, evaluates as pytest's own parser evaluates it."""
    expressions = [
        *EXPRESSIONS,
        "not not ddp",
        "(ddp)",
        "ddp or sharded and beyond",
        "COURSE and not (ws2 or ws3) or fsdp",
        "notebook or android",
        "test_hooks.py",
    ]
    for expression in expressions:
        ours, theirs = keywords.matcher(expression), Expression.compile(expression)
        for case in CASES.values():
            names = keywords.case_names(case)
            wanted = theirs.evaluate(lambda sub, names=names: any(sub.lower() in n.lower() for n in names))
            assert ours(case) == wanted, (expression, case.id)


@pytest.mark.parametrize("expression", ["ddp and", "(ddp", "ddp)", "not", "ddp(x=1)", "ddp = 1", "or ddp"])
def test_an_expression_that_does_not_parse_is_a_usage_error(expression: str, capsys) -> None:
    with pytest.raises(keywords.KeywordError):
        keywords.matcher(expression)
    assert judging.run(judging.JudgeConfig(adapters=DQ_BUG, keyword=expression)) == judging.USAGE_ERROR
    assert capsys.readouterr().err.startswith("ERROR: ")


def test_an_empty_selection_grades_nothing(capsys) -> None:
    config = judging.JudgeConfig(adapters=DQ_BUG, keyword="no-case-is-named-this")
    assert judging.run(config) == judging.NONE_SELECTED
    assert "no case selected" in capsys.readouterr().out


class _StandIn:
    """A grader without workers whose judging of one case raises (a bug of the grader's own)."""

    def __init__(self, broken: str) -> None:
        self.broken = broken

    def plan(self, cases: list) -> None:
        pass

    def close(self) -> None:
        pass

    def worker_seconds(self, case_id: str) -> dict:
        return {}

    def verdict(self, case) -> Verdict:
        if case.id == self.broken:
            raise RuntimeError("a bug in the judge")
        return Verdict.passed()


def test_a_judging_that_raises_fails_its_case_and_the_run_goes_on() -> None:
    """The case stays in the report as one the grader could not grade (0 of 0 on Gradescope, never the
    student's failure), with a visible "grader failed": dropping it would hide the grader's bug from the
    student's results."""
    first, second, third = list(CASES.values())[:3]
    judged, marks = judging.Judged(Recorder(1, "adapters.py")), []
    judging.judge_cases(_StandIn(second.id), [first, second, third], judged, marks.append)
    assert marks == [".", "F", "."] and judged.finished
    assert list(judged.recorder.cases) == [first.id, second.id, third.id]
    entry = judged.recorder.cases[second.id]
    assert (entry["status"], entry["kind"]) == ("error", "grader-raised")
    assert "a bug in the judge" in entry["message"] and "a bug in the judge" in judged.crashed[second.id]
    doc = gradescope.results(judged.recorder.report(), gradescope.load_points(None))
    assert any(t["name"] == "grader failed" for t in doc["tests"])
    assert judging.status_of(judged, external=False) == judging.FAILURES


def _verdicts(report: Path) -> dict[str, tuple[str, str, str]]:
    cases = json.loads(report.read_text())["cases"]
    return {c["id"]: (c["status"], c["kind"], c["message"]) for c in cases}


def _installed(tmp_path: Path) -> dict[str, str]:
    """The package alone in a folder of its own, as pip installs it (no tests/, no checkout around it),
    and an environment that imports it from there."""
    site = tmp_path / "site"
    shutil.copytree(
        ROOT / "src" / "cs336_systems", site / "cs336_systems", ignore=shutil.ignore_patterns("__pycache__")
    )
    env = clean_env() | {"PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "import cs336_systems; print(cs336_systems.__file__)"],
        env=env,
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert Path(where.stdout.strip()).is_relative_to(site), where.stdout + where.stderr
    return env


def test_an_installed_package_grades_a_repository(tmp_path: Path) -> None:
    """``repo_job`` from a copy of the package, in a folder with no tests/: the judging process is the
    package's, and its verdicts are those of the checkout's judge on the same seed."""
    env = _installed(tmp_path)
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"tiers": "course,beyond", "seed": 7, "judge_args": ["-k", SELECTION]}))
    cmd = [sys.executable, "-m", "cs336_systems.grading.repo.repo_job", str(DQ_BUG), "--out", str(out)]
    run = subprocess.run(
        [*cmd, "--options", str(options)], cwd=work, env=env, capture_output=True, text=True, timeout=280
    )
    log = (out / "contract.log").read_text() if (out / "contract.log").is_file() else ""
    assert run.returncode == 0 and (out / "grade.json").is_file(), run.stderr[-2000:] + log[-2000:]
    installed = _verdicts(out / "grade.json")
    assert [v[0] for v in installed.values()] == ["passed", "failed"], installed
    here = tmp_path / "checkout.json"
    cmd = [
        sys.executable,
        "-m",
        "cs336_systems.grading.judge",
        f"--adapters={DQ_BUG}",
        f"--grade-json={here}",
    ]
    cmd += ["--grade-seed=7", "--grade-tiers=course,beyond", "-k", SELECTION]
    checkout = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=280)
    assert checkout.returncode == 0, checkout.stdout[-2000:] + checkout.stderr[-2000:]
    assert _verdicts(here) == installed
