"""Each repository's grading on a network of its own (``grading/network.py``): a process that entered it
reaches its own loopback and nothing of the network it left; the isolation record says which network the
repository had ("shared" with ``CS336_GRADE_ISOLATION=subreaper``, or where the namespace cannot be
made); code graded beside another repository cannot connect to that repository's ports
(``adapters_reach_neighbours.py`` scans ``/proc/net/tcp`` and connects to every listener, as an attacker
would); and cases of several ranks (gloo over loopback) are graded as before inside the namespace."""

from __future__ import annotations

import json
import os
import pwd
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.grading import network
from cs336_systems.grading.sandbox import Sandbox
from cs336_systems.grading.settings import ISOLATION_ENV, NETWORK_ENV
from cs336_systems.grading.shared.cases import CASES

from .grading_run import ROOT, STUDENTS, clean_env

pytestmark = pytest.mark.timeout(300)
needs_netns = pytest.mark.skipif(
    not network.can_isolate(), reason="needs root or unprivileged user namespaces"
)
SRC = str(ROOT / "src")
NEIGHBOURS = STUDENTS / "adversary" / "tests" / "adapters_reach_neighbours.py"
ONE_CASE = "course-pytorch-match-b4-q128-k128-d64-full-fp32"


def _python(
    code: str, env: dict[str, str] | None = None, user: str | None = None
) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-c", code]
    if user is not None:
        cmd = ["setpriv", f"--reuid={user}", f"--regid={pwd.getpwnam(user).pw_gid}", "--clear-groups", *cmd]
    env = clean_env() | {"PYTHONPATH": SRC} | (env or {})
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)


def _accepted(server: socket.socket) -> int:
    """How many connections reached ``server`` (a closed one still waits in its queue)."""
    server.setblocking(False)
    count = 0
    while True:
        try:
            server.accept()[0].close()
        except BlockingIOError:
            return count
        count += 1


REACH = """
import socket, sys
from cs336_systems.grading import network
print(network.isolate(True))
for port in map(int, sys.argv[1:]):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        print("outside reached")
    except OSError:
        print("outside not reached")
with socket.create_server(("127.0.0.1", 0)) as own:
    socket.create_connection(own.getsockname(), timeout=2).close()
    print("own reached")
"""


@needs_netns
def test_a_private_network_reaches_its_own_loopback_only() -> None:
    with socket.create_server(("127.0.0.1", 0)) as outside:
        run = _python(REACH.replace("sys.argv[1:]", f"[{outside.getsockname()[1]}]"))
        assert run.stdout.split() == ["own", "outside", "not", "reached", "own", "reached"], run.stderr
        assert _accepted(outside) == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="drops to an unprivileged user: needs root")
def test_an_unprivileged_process_gets_a_user_namespace_and_keeps_no_capability() -> None:
    """Not root: a user namespace too, the uid mapped to itself; its children hold no capability."""
    code = (
        "import subprocess\nfrom cs336_systems.grading import network\n"
        "print(network.isolate(True), open('/proc/self/uid_map').read().split())\n"
        "print(subprocess.run(['grep', 'CapEff', '/proc/self/status'], capture_output=True, text=True).stdout)\n"
    )
    run = _python(code, user="nobody")
    if "Permission denied" in run.stderr or "unshare: " in run.stderr:
        pytest.skip(f"nobody cannot run the suite or make a user namespace here: {run.stderr[-300:]}")
    uid = str(pwd.getpwnam("nobody").pw_uid)
    assert run.stdout.split() == ["own", f"['{uid}',", f"'{uid}',", "'1']", "CapEff:", "0" * 16], run.stderr


@pytest.mark.parametrize(("isolation", "expected"), [(None, "own"), ("subreaper", "shared")])
def test_the_isolation_record_names_the_network(isolation: str | None, expected: str) -> None:
    if expected == "own" and not network.can_isolate():
        pytest.skip("no network namespace here")
    code = (
        "import json\nfrom cs336_systems.grading import network, sandbox, settings\n"
        "network.isolate(settings.namespaces_wanted())\n"
        "record = sandbox.Sandbox.from_env().isolation()\n"
        "print(json.dumps([record, sandbox.describe(record)]))\n"
    )
    run = _python(code, {ISOLATION_ENV: isolation} if isolation else {})
    record, line = json.loads(run.stdout)
    assert record["network"] == expected and f", {expected} network" in line, run.stdout + run.stderr
    words = "a network of its own" if expected == "own" else "the network is shared"
    assert words in record["covers"], record


def test_a_record_of_another_namespace_is_a_shared_network(monkeypatch: pytest.MonkeyPatch) -> None:
    """The judge says "own" only on the namespace its ``repo_job`` made, not on an inherited record."""
    monkeypatch.setenv(NETWORK_ENV, "net:[1]")
    assert Sandbox().isolation()["network"] == "shared"
    monkeypatch.setenv(NETWORK_ENV, network.namespace_id())
    assert Sandbox().isolation()["network"] == "own"


def test_where_it_cannot_be_made_grading_goes_on_on_the_shared_network() -> None:
    """A process that already runs a thread would take only that thread along: it stays, and says why."""
    code = (
        "import os, threading, time\nfrom cs336_systems.grading import network\n"
        "threading.Thread(target=time.sleep, args=(5,), daemon=True).start()\n"
        "print(network.isolate(True), network.here(), os.environ.get('GLOO_SOCKET_IFNAME'))\n"
    )
    run = _python(code)
    assert run.stdout.split() == ["shared", "shared", "None"], run.stdout + run.stderr
    assert "grading on the shared network: this process already runs 2 threads" in run.stderr


def _repo_job(target: Path, out: Path, judge_args: list[str]) -> tuple[int, dict]:
    """``repo_job`` as a class run starts it: its exit status and ``grade.json``."""
    options = out.parent / "options.json"
    options.write_text(json.dumps({"tiers": "course", "judge_args": judge_args}))
    cmd = [sys.executable, "-m", "cs336_systems.grading.repo.repo_job", str(target), "--out", str(out)]
    run = subprocess.run(
        [*cmd, "--options", str(options)], cwd=ROOT, env=clean_env(), capture_output=True, timeout=280
    )
    report = out / "grade.json"
    assert report.is_file(), (out / "contract.log").read_text()[-3000:] if out.is_dir() else run.stderr
    return run.returncode, json.loads(report.read_text())


@needs_netns
def test_a_repository_cannot_reach_another_repositorys_ports(tmp_path: Path) -> None:
    """The listener stands for a neighbouring repository's store, on the machine's network. The graded
    code scans for listening ports and connects to each: it sees and reaches its own, not the neighbour."""
    with socket.create_server(("127.0.0.1", 0)) as neighbour:
        code, report = _repo_job(NEIGHBOURS, tmp_path / "out", ["-k", ONE_CASE])
        reached = _accepted(neighbour)
        port = neighbour.getsockname()[1]
    assert report["isolation"]["network"] == "own", report["isolation"]
    (case,) = report["cases"]
    said = re.search(r"own (\d+); seen \[(.*?)\]; reached \[(.*?)\]", case["message"])
    assert code == 1 and said, case
    assert reached == 0, f"the neighbour's port {port} was reached: {said[0]}"
    own, seen, reached_ports = said.groups()
    assert seen == reached_ports == own, said[0]  # the scan works: it found and reached its own listener


@needs_netns
def test_ranks_rendezvous_and_talk_inside_the_namespace(tmp_path: Path) -> None:
    """DDP, the sharded optimizer and FSDP, graded through ``repo_job`` (the suite's own hooks)."""
    code, report = _repo_job(
        ROOT / "tests" / "adapters.py", tmp_path / "out", ["-k", "ddp or sharded or fsdp"]
    )
    assert report["isolation"]["network"] == "own", report["isolation"]
    cases = report["cases"]
    assert {c["status"] for c in cases} == {"passed"} and code == 0, [
        c for c in cases if c["status"] != "passed"
    ]
    assert sum(CASES[c["id"]].world_size > 1 for c in cases) >= 10, [c["id"] for c in cases]
