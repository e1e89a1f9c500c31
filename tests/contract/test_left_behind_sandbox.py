"""The sandbox's parts, each alone and fast: a subreaper finds and kills a detached grandchild; a worker in
namespaces writes only its scratch (``out/``, a private ``/tmp`` and ``/dev/shm``), sees none of the grader's processes, and
leaves nothing behind; a class run's time limit stops what left the job's process group; a regrade
whose job dies before writing never keeps the previous ``results.json``; a worker time limit reached on
an overloaded machine (a stand-in load reading) is "could not grade here", one on an idle one a failure;
a job's wait interrupted (Ctrl-C, a caller's time limit) kills its ranks before the exception goes on."""

from __future__ import annotations

import json
import os
import pwd
import shlex
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from cs336_systems.grading.class_run.classroom import ClassRun, stop
from cs336_systems.grading.judge import runner
from cs336_systems.grading.judge.runner import Machine
from cs336_systems.grading.judge.session import Grader
from cs336_systems.grading.probe import probe
from cs336_systems.grading.repo.repo_job import RepoOptions, grade_repo
from cs336_systems.grading.roots import discover
from cs336_systems.grading.sandbox import JobFolder, Sandbox, namespaces_work
from cs336_systems.grading.shared.cases import CASES, UNFINISHED_HERE
from cs336_systems.grading.verdict import FAILED, SKIPPED, Verdict

from .grading_run import ROOT, STUDENTS, clean_env
from .test_left_behind import alive

pytestmark = pytest.mark.timeout(120)
SRC = str(ROOT / "src")


def _detach(marker: str, started: Path = Path(os.devnull)) -> str:
    """Shell that leaves a sleeping process, ``marker`` in its command line, in a session of its own (the
    subshell that started it exits at once); it writes ``started`` first."""
    code = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).write_text('up'); time.sleep(60)"
    sleeper = shlex.join([sys.executable, "-c", code, str(started), marker])
    return f"(setsid {sleeper} >/dev/null 2>&1 &)"


def _python(code: str) -> subprocess.CompletedProcess:
    env = clean_env() | {"PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)


def test_a_subreaper_kills_a_detached_grandchild() -> None:
    marker = f"detached-{uuid.uuid4().hex}"
    code = (
        "import subprocess, time\n"
        "from cs336_systems.grading.sandbox import become_subreaper, descendants, kill_descendants\n"
        "assert become_subreaper()\n"
        f"subprocess.run({_detach(marker)!r}, shell=True)\n"
        "time.sleep(0.5)\n"
        "assert descendants(), 'the detached process is below this one'\n"
        "print('left', kill_descendants(5.0))\n"
    )
    run = _python(code)
    assert run.returncode == 0 and "left []" in run.stdout, run.stdout + run.stderr
    assert not alive(marker)


@pytest.mark.skipif(
    not namespaces_work(), reason="needs root or unprivileged user namespaces, and util-linux"
)
def test_a_worker_in_namespaces_writes_only_its_scratch(tmp_path: Path) -> None:
    marker = f"inside-{uuid.uuid4().hex}"
    job = JobFolder.make(tmp_path)
    outside = ROOT / "tests" / "data" / f".forged-{marker}"  # the suite's tree, outside any /tmp
    script = (
        f"touch {job.path}/forged {outside}; touch {job.out}/record /tmp/{marker} /dev/shm/{marker}; "
        f"{_detach(marker, job.out / 'up')}; ls /proc | grep -c '^[0-9]' > {job.out}/processes; "
        f"for i in $(seq 50); do [ -e {job.out}/up ] && break; sleep 0.1; done; "
        f"mount -o remount,bind,rw / 2>/dev/null; touch {outside}"
    )
    try:
        cmd = Sandbox(scratch=tmp_path / "scratch").wrap(["sh", "-c", script], job, [], job.path)
        (tmp_path / "scratch").mkdir()
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        assert (job.out / "record").exists(), run.stderr
        assert not (job.path / "forged").exists(), "the job's own folder was written"
        assert not outside.exists(), "the suite's tree was written (or the read-only mount undone)"
        assert (job.tmp / marker).exists() and not (Path("/tmp") / marker).exists(), "/tmp is not private"
        assert (job.shm / marker).exists() and not (Path("/dev/shm") / marker).exists(), "/dev/shm is shared"
        seen = int((job.out / "processes").read_text())
        assert seen < 10, f"the worker sees {seen} processes: the grader's are visible"
        assert (job.out / "up").exists(), "the detached process did not start"
        assert not alive(marker), "a process the worker left outlived it"
    finally:
        outside.unlink(missing_ok=True)
        job.remove()


def test_a_time_limit_stops_what_left_the_process_group() -> None:
    """The job (a subreaper, as ``repo_job`` is) started a process in a session of its own."""
    marker = f"job-left-{uuid.uuid4().hex}"
    code = (
        "import subprocess, time\n"
        "from cs336_systems.grading.sandbox import become_subreaper\n"
        "become_subreaper()\n"
        f"subprocess.run({_detach(marker)!r}, shell=True)\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    env = clean_env() | {"PYTHONPATH": SRC}
    job = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        assert job.stdout.readline().strip() == "started"
        assert alive(marker)
        stop(job)
        assert not alive(marker), "the time limit left a process of the job running"
    finally:
        for pid in alive(marker):
            os.kill(pid, signal.SIGKILL)
        job.kill()
        job.wait()


def test_a_regrade_whose_job_dies_keeps_no_stale_results(tmp_path: Path) -> None:
    stale = {"score": 100.0, "tests": [], "output": "an earlier grade"}
    out = tmp_path / "class"
    (out / "repo").mkdir(parents=True)
    (out / "repo" / "results.json").write_text(json.dumps(stale))
    run = ClassRun({}, out, RepoOptions(), log=open(os.devnull, "w"))  # noqa: SIM115
    job = run._spawn("repo", STUDENTS / "src_layout", None, 1)
    os.killpg(job.proc.pid, signal.SIGKILL)  # dies before it writes anything
    outcome = run._outcome(job, job.proc.wait(), 0.0)
    results = json.loads((out / "repo" / "results.json").read_text())
    assert outcome.startswith("grading failed") and "died" in outcome, outcome
    assert results != stale and results["score"] == 0.0, results


HANG = next(c for c in CASES if c.startswith("course-pytorch"))
LIMIT = 4.0  # seconds: a job lasts its limit and less than as much again on a loaded machine


def _hang_verdict(loads: list[float]) -> tuple[Verdict, int]:
    """The verdict of an attention that never returns, under a 4 s worker time limit, on a machine whose
    load readings are ``loads`` in turn (the last one repeated); how many jobs ran (each one lasts its
    time limit, and little more)."""
    seen: list[float] = []

    def load() -> float:
        seen.append(loads[min(len(seen), len(loads) - 1)])
        return seen[-1]

    roots = discover(STUDENTS / "hangs" / "tests" / "adapters.py")
    grader = Grader(roots, probe(roots.adapters), 1, timeout=LIMIT, machine=Machine(load, cores=2))
    started = time.monotonic()
    verdict = grader.verdict(CASES[HANG])
    return verdict, int((time.monotonic() - started) // LIMIT)


def test_a_time_limit_on_a_busy_machine_is_not_the_codes() -> None:
    """Retried once; busy again, left out of the score with the load seen."""
    verdict, jobs = _hang_verdict([9.0])
    assert verdict.status == SKIPPED and verdict.kind == UNFINISHED_HERE, verdict
    assert "could not grade here" in verdict.message and "load 9.0 on 2 cores" in verdict.message, verdict
    assert jobs == 2, f"{jobs} jobs: one retry expected"


def test_a_hang_on_an_idle_machine_stays_the_codes() -> None:
    verdict, jobs = _hang_verdict([0.5])
    assert verdict.status == FAILED and "timed out after 4 s" in verdict.message and jobs == 1, verdict
    verdict, jobs = _hang_verdict([9.0, 0.5])  # busy, then idle on the retry: the retry's verdict
    assert verdict.status == FAILED and jobs == 2, (verdict, jobs)


@pytest.mark.skipif(os.geteuid() != 0, reason="a worker user applies when the grader is root")
@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces", "subreaper"])
def test_workers_run_as_the_worker_user_without_capabilities(namespaces: bool, tmp_path: Path) -> None:
    if namespaces and not namespaces_work():
        pytest.skip("no namespaces on this machine")
    job = JobFolder.make(tmp_path)
    cmd = Sandbox(worker_user="nobody", namespaces=namespaces, scratch=tmp_path).wrap(
        ["sh", "-c", "id -u; grep CapEff /proc/self/status"], job, [], job.path
    )
    said = subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.split()
    assert said == [str(pwd.getpwnam("nobody").pw_uid), "CapEff:", "0000000000000000"], said


def test_an_unknown_worker_user_is_one_line(tmp_path: Path) -> None:
    code = grade_repo(STUDENTS / "src_layout", tmp_path, RepoOptions(worker_user="no-such-user-here"))
    assert code == 2
    assert (tmp_path / "failure.txt").read_text().strip() == (
        "cannot grade: --worker-user no-such-user-here: no such user on this machine"
    )


def test_a_failure_in_a_network_errors_words_stays_the_codes() -> None:
    """An attention that raises "Connection reset by peer" on an idle machine: retried once (a reset can
    be the machine's), then failed with its message, not left out of the score."""
    roots = discover(STUDENTS / "adversary" / "tests" / "adapters_blames_network.py")
    grader = Grader(roots, probe(roots.adapters), 1, timeout=60, machine=Machine(lambda: 0.5, cores=2))
    verdict = grader.verdict(CASES[HANG])
    assert verdict.status == FAILED and "Connection reset by peer" in verdict.message, verdict
    busy = Grader(roots, probe(roots.adapters), 1, timeout=60, machine=Machine(lambda: 9.0, cores=2))
    verdict = busy.verdict(CASES[HANG])  # a busy machine's reset stays the machine's
    assert verdict.status == SKIPPED and verdict.kind == UNFINISHED_HERE, verdict


def test_an_interrupted_wait_leaves_no_rank_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C or a caller's time limit (pytest-timeout raises in the waiting thread) while ranks run:
    every rank is killed before the exception goes on."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"]) for _ in range(2)]

    def interrupted(seconds: float) -> None:
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.time, "sleep", interrupted)
    try:
        with pytest.raises(KeyboardInterrupt):
            runner._watch(procs, timeout=60)
        assert [p.poll() for p in procs] == [-9, -9]
    finally:
        for p in procs:
            p.kill()
