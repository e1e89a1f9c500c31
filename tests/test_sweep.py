"""``python -m cs336_systems.cli.sweep`` on this machine (submitit's LocalExecutor, the code path a Slurm
sweep takes too): four real CPU bench cases (the tiny model's warm-up rows, the cheapest) give the same
case ids and rows as the plain pytest run, the report reads the merge, and a rerun after a case was lost
runs only that case. A failed job is a row with its error (merged from a written status, no job)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cs336_systems.harness.sweep import case_files, merge, slug
from cs336_systems.report.load import load

REPO = Path(__file__).parents[1]
SELECTION = ["bench/bench_model.py", "-k", "test_warmup and tiny"]
# What differs between two runs of one case: its timings and the machine's load at the time.
VARYING = {"mean_ms", "std_ms", "median_ms", "load_avg_1m", "rounds_spread", "first_ms", "max_ms"}
VARYING |= {"tokens_per_s", "tflops", "mfu", "matmul_tflops", "job"}
# Five pytest runs in all (the plain one, four jobs), each importing torch: about 1.5 min on two quiet
# cores, over 5 on two cores at a load of 8; the module fixture counts against the first test's limit.
# One xdist group (tox runs `--dist loadgroup`): the module runs in one worker, which makes its
# fixture's five pytest runs once rather than once per worker.
pytestmark = [pytest.mark.timeout(900), pytest.mark.xdist_group("test_sweep")]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "XDIST"))}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")])
    env["OMP_NUM_THREADS"] = "1"
    return env


def run_sweep(out: Path, *args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "cs336_systems.cli.sweep", *SELECTION, "--out", str(out)]
    command += ["--executor", "local", "--parallelism", "2", "--time-min", "5", *args]
    return subprocess.run(command, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=400)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, subprocess.CompletedProcess]:
    base = tmp_path_factory.mktemp("sweep")
    plain = base / "plain.json"
    command = [sys.executable, "-m", "pytest", *SELECTION, "-q", "-p", "no:cacheprovider"]
    done = subprocess.run(
        [*command, f"--benchmark-json={plain}"],
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    sweep = run_sweep(base / "sweep")
    assert sweep.returncode == 0, sweep.stdout[-2000:] + sweep.stderr[-2000:]
    return plain, base / "sweep", sweep


def _shape(row: dict) -> tuple:
    extra = {k: v for k, v in row["extra_info"].items() if k not in VARYING}
    return (
        row["fullname"],
        row["group"],
        json.dumps(row["params"], sort_keys=True),
        json.dumps(extra, sort_keys=True),
    )


def test_sweep_gives_the_plain_runs_rows(runs) -> None:
    plain, out, sweep = runs
    expected = json.loads(plain.read_text())["benchmarks"]
    merged = json.loads((out / "sweep.json").read_text())["benchmarks"]
    assert len(expected) == 4
    assert [_shape(r) for r in merged] == [_shape(r) for r in expected]
    # Each row keeps the machine its job ran on, and the job.
    assert all(r["extra_info"]["job"]["host"] and r["extra_info"]["job"]["job_id"] for r in merged)
    assert "jobs: 0 pending 0 running 4 done 0 failed" in sweep.stdout
    _, records = load([out / "sweep.json"])
    assert sorted(r.name for r in records) == sorted(r["name"] for r in expected)
    assert {r.group_key for r in records} == {"warmup"}


def test_rerun_runs_only_the_missing_case(runs, tmp_path: Path) -> None:
    _, out, _ = runs
    copy = tmp_path / "sweep"
    shutil.copytree(out, copy)
    merged = json.loads((copy / "sweep.json").read_text())["benchmarks"]
    lost = merged[1]["fullname"]
    shutil.rmtree(case_files(copy, lost).folder)  # as if the sweep had stopped before this case ran
    before = {p.name for p in (copy / "jobs").glob("*_submitted.pkl")}
    again = run_sweep(copy)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    assert "4 case(s) selected, 3 done earlier, 1 to run" in again.stdout
    new = {p.name for p in (copy / "jobs").glob("*_submitted.pkl")} - before
    assert len(new) == 1
    rows = json.loads((copy / "sweep.json").read_text())["benchmarks"]
    assert [r["fullname"] for r in rows] == [r["fullname"] for r in merged]
    redone = next(r for r in rows if r["fullname"] == lost)
    assert redone["extra_info"]["job"]["job_id"] == new.pop().split("_")[0]


def test_a_failed_job_is_a_row_with_its_error(runs, tmp_path: Path) -> None:
    _, out, _ = runs
    copy = tmp_path / "sweep"
    shutil.copytree(out, copy)
    node_ids = [r["fullname"] for r in json.loads((copy / "sweep.json").read_text())["benchmarks"]]
    failed = "bench/bench_model.py::test_warmup[gone]"
    case_files(copy, failed).write_status(state="failed", error="TIMEOUT: ran past 300 s", job_id="77")
    rows = merge(copy, [*node_ids, failed])["benchmarks"]
    assert len(rows) == 5
    assert rows[-1]["extra_info"]["skipped"] == "job 77 failed: TIMEOUT: ran past 300 s"
    path = tmp_path / "merged.json"
    path.write_text(json.dumps({"machine_info": {}, "benchmarks": rows}))
    _, records = load([path])  # the report takes the failed row beside the others
    assert [r.skipped for r in records if r.name == "test_warmup[gone]"] == [
        "job 77 failed: TIMEOUT: ran past 300 s"
    ]


def test_case_folders_are_distinct() -> None:
    assert slug("b.py::t[a/b]") != slug("b.py::t[a_b]")
    assert "/" not in slug("b.py::t[a/b]")


@pytest.mark.parametrize(("visible", "expected"), [(None, ["0", "1"]), ("5,7", ["5", "7"])])
def test_cases_side_by_side_each_claim_their_own_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, visible: str | None, expected: list[str]
) -> None:
    """On one machine submitit gives every job the same first GPUs: two cases running at once must each
    see a GPU of their own, or the sweep times two cases on one GPU. Under ``CUDA_VISIBLE_DEVICES=5,7`` they
    are GPUs 5 and 7: a child told "0" would time on GPU 0, outside what the sweep was given."""
    from concurrent.futures import ThreadPoolExecutor

    from cs336_systems.harness.sweep import BenchCase
    from cs336_systems.jobs.executor import LocalGpus

    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)

    # A stand-in interpreter: records the GPUs it was shown, holds them a moment, writes no JSON.
    fake = tmp_path / "python"
    fake.write_text(
        '#!/bin/sh\nfor a in "$@"; do case $a in --benchmark-json=*) out=${a#--benchmark-json=};; esac; done\n'
        'echo "$CUDA_VISIBLE_DEVICES" > "$out.gpus"; sleep 1\n'
    )
    fake.chmod(0o755)
    local = LocalGpus.seen(tmp_path / "locks", total=2, per_job=1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")  # what submitit shows every job: not the GPUs above
    cases = [
        BenchCase(f"b.py::t[{i}]", tmp_path / f"c{i}" / "bench.json", str(fake), tmp_path, [], 30, local)
        for i in range(2)
    ]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda case: case(), cases))
    seen = sorted((tmp_path / f"c{i}" / "bench.json.gpus").read_text().strip() for i in range(2))
    assert seen == expected, seen
    assert sorted(r["gpus"] for r in results) == expected


@pytest.mark.parametrize(("rc", "state"), [(1, "failed"), (0, "done")])
def test_a_case_whose_pytest_failed_is_failed_even_with_rows(tmp_path: Path, rc: int, state: str) -> None:
    """A case can write its row and fail after it (an assertion on what it measured, a teardown): its
    job's pytest failed, so it is not done; the merge shows its error and a rerun submits it again."""
    from cs336_systems.harness.sweep import BenchCase, finished, job_outcome, unfinished
    from cs336_systems.jobs.run import Outcome

    node_id = "bench/b.py::test_x[a]"
    row = {
        "group": "g",
        "name": "test_x[a]",
        "fullname": node_id,
        "params": {},
        "stats": {},
        "extra_info": {},
    }
    fake = tmp_path / "python"  # a stand-in interpreter: writes the case's row, then pytest's exit status
    fake.write_text(
        '#!/bin/sh\nfor a in "$@"; do case $a in --benchmark-json=*) out=${a#--benchmark-json=};; esac; done\n'
        f"echo '{json.dumps({'machine_info': {}, 'benchmarks': [row]})}' > \"$out\"\n"
        f"echo '1 {'failed' if rc else 'passed'}'; exit {rc}\n"
    )
    fake.chmod(0o755)
    files = case_files(tmp_path / "sweep", node_id)
    result = BenchCase(node_id, files.bench, str(fake), tmp_path, [], 30)()
    assert files.bench.is_file() and result["rc"] == rc
    status = job_outcome(files.bench, Outcome("9", "done", result=result))
    assert status["state"] == state, status
    files.write_status(**status, job_id="9")
    assert finished(tmp_path / "sweep", node_id) == (rc == 0)
    assert unfinished(tmp_path / "sweep", node_id) == (rc != 0)
    (merged,) = merge(tmp_path / "sweep", [node_id])["benchmarks"]
    if rc:
        assert merged["extra_info"]["skipped"].startswith("job 9 failed: pytest exit 1"), merged
    else:
        assert "skipped" not in merged["extra_info"], merged
