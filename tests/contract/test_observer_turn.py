"""Observed runs of one host take turns (two Nsight Compute sessions side by side starve each other), and
a repository's time limit does not count its wait for that turn: a class run stops a job only once it
has run its limit beyond what it spent behind another repository's observation. An observer starved by a
session the lock does not cover (it reached the worker, saw no kernel) looks once more."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from cs336_systems.grading.class_run.class_executor import _wait
from cs336_systems.grading.repo.leaderboard import observer_turn
from cs336_systems.grading.repo.leaderboard.observer import Observed
from cs336_systems.grading.repo.leaderboard.row import observe


def test_a_second_observer_waits_and_its_wait_is_recorded(tmp_path: Path) -> None:
    lock = observer_turn.lock_path(tmp_path)
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    got: list[float] = []

    def waiter() -> None:
        with observer_turn.turn(lock, second / observer_turn.WAIT_FILE):
            got.append(time.monotonic())

    with observer_turn.turn(lock, first / observer_turn.WAIT_FILE):
        thread = threading.Thread(target=waiter)
        thread.start()
        time.sleep(1.0)
        assert not got, "the second observer ran while the first held the turn"
        assert "since" in json.loads((second / observer_turn.WAIT_FILE).read_text())
        assert observer_turn.waited_s(second) >= 0.9
        released = time.monotonic()
    thread.join(10)
    assert got and got[0] >= released
    after = json.loads((second / observer_turn.WAIT_FILE).read_text())
    assert "since" not in after and 0.9 <= after["waited_s"] < 10
    assert observer_turn.waited_s(first) < 0.5  # the first never waited


def test_the_wait_for_the_observer_extends_a_jobs_limit(tmp_path: Path) -> None:
    sleeper = [sys.executable, "-c", "import time; time.sleep(2.5)"]
    assert _wait(subprocess.Popen(sleeper), 1.0, tmp_path) == "timeout"
    (tmp_path / observer_turn.WAIT_FILE).write_text(json.dumps({"waited_s": 5.0}))
    assert _wait(subprocess.Popen(sleeper), 1.0, tmp_path) == 0


def test_an_unreadable_record_extends_nothing(tmp_path: Path) -> None:
    (tmp_path / observer_turn.WAIT_FILE).write_text("{not json")
    assert observer_turn.waited_s(tmp_path) == 0.0
    assert observer_turn.waited_s(tmp_path / "absent") == 0.0


def test_the_lock_is_per_host(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(observer_turn.platform, "node", lambda: "node-a")
    a = observer_turn.lock_path(tmp_path)
    monkeypatch.setattr(observer_turn.platform, "node", lambda: "node-b")
    assert observer_turn.lock_path(tmp_path) != a


# A stand-in for a repository's grading process: it waited ``sys.argv[2]`` seconds for its observer's turn
# (the record ``observer_turn.turn`` keeps), then works 2.5 s and writes its results.
REPO_JOB = """
import json, pathlib, sys, time
out, waited = pathlib.Path(sys.argv[1]), float(sys.argv[2])
if waited:
    (out / "observer_wait.json").write_text(json.dumps({"waited_s": waited}))
time.sleep(2.5)
(out / "results.json").write_text(json.dumps({"score": 0, "tests": []}))
"""


@pytest.mark.parametrize(("waited_s", "outcome"), [(0.0, "grading failed: timed out"), (5.0, "graded in")])
def test_the_one_machine_class_run_adds_the_wait_to_a_repositorys_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, waited_s: float, outcome: str
) -> None:
    """The class run's own scheduler (no ``--executor``) stops a repository at its limit plus its wait."""
    from cs336_systems.grading.class_run import classroom
    from cs336_systems.grading.limits import Limits
    from cs336_systems.grading.repo.repo_job import RepoOptions

    from .grading_run import STUDENTS

    def command(target: Path, out: Path, options: Path) -> list[str]:
        return [sys.executable, "-c", REPO_JOB, str(out), str(waited_s)]

    monkeypatch.setattr(classroom, "repo_command", command)
    repos = {"a": STUDENTS / "src_layout"}
    outcomes = classroom.ClassRun(
        repos, tmp_path, RepoOptions(limits=Limits(1.0)), jobs=1, log=io.StringIO()
    ).run()
    assert outcomes["a"].startswith(outcome), outcomes


def _seen(ms: float, connected: bool = True) -> Observed:
    seen = Observed.of_phases({"fwd_kernel": ms}, {"bwd_kernel": ms}) if ms else Observed()
    seen.connected = connected
    return seen


@pytest.mark.parametrize(
    ("readings", "seconds"),
    [
        ([_seen(0.0), _seen(2.0)], 300.0),  # starved once by another session: observed again
        ([_seen(0.0), _seen(0.0)], 300.0),  # the recording stopped by the code: empty twice
        ([_seen(2.0)], 300.0),  # an honest reading is taken as it is
        ([_seen(0.0, connected=False)], 300.0),  # never reached: the row says so, no second run
        ([_seen(0.0)], 10.0),  # too little of the row's time left for a second run
    ],
)
def test_an_observer_that_saw_nothing_looks_once_more(readings: list[Observed], seconds: float) -> None:
    asked: list[float | None] = []

    def once(left: float | None) -> tuple[Observed, int, None]:
        asked.append(left)
        return readings[len(asked) - 1], 1, None

    seen, _, _ = observe(once, seconds)
    assert len(asked) == len(readings) and seen is readings[-1]
    assert all(a is not None and a <= seconds for a in asked)  # the second run fits what is left
