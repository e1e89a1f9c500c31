"""Sweep bench cases as jobs: ``python -m cs336_systems.cli.sweep BENCH_FILES... [--only P=V] [-k EXPR]
--out runs/sweep [--executor local|slurm|auto ...]``.

Collects the cases ``pytest BENCH_FILES --only ... -k ...`` would run, submits one job per case (on
Slurm through submitit's AutoExecutor, else on this machine through its LocalExecutor), each a pytest
run writing its own pytest-benchmark JSON, and merges them into ``OUT/sweep.json``, which
``python -m cs336_systems.report OUT/sweep.json`` reads like a single run's. The job counts (pending /
running / done / failed) are printed as they change. A failed, cancelled or timed-out job is a row
carrying its error. Each case's status is written as its job ends: Ctrl-C (or ``kill``) cancels the jobs
still running and keeps what finished (exit 130, or 143). Rerun the same command to resume: only the
cases missing, failed, cancelled or timed out are submitted. Arguments after ``--`` go to every case's
pytest run (``-- --adapters PATH``).

Example: ``python -m cs336_systems.cli.sweep bench/bench_flash.py --only d=64,128 --out runs/d11
--executor slurm --partition gpu --gpus-per-job 1 --parallelism 8 --time-min 30``
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cs336_systems.cli.common import Parser, check_outputs
from cs336_systems.harness.sweep import (
    BenchCase,
    SweepError,
    case_files,
    collect,
    finished,
    job_outcome,
    merge,
    unfinished,
)
from cs336_systems.jobs.executor import (
    ExecutorConfig,
    ExecutorError,
    LocalGpus,
    add_executor_options,
    config_from_args,
    describe,
    local_gpu_count,
)
from cs336_systems.jobs.interrupt import Interrupted
from cs336_systems.jobs.run import Outcome, Watch, run_jobs


def parser() -> Parser:
    p = Parser("sweep", description=__doc__)
    p.add_argument("bench_files", nargs="+", help="bench files (or folders) to sweep, as pytest takes them")
    p.add_argument("--only", action="append", default=[], metavar="PARAM=V1,V2", help="bench selection")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression on the case ids")
    p.add_argument("--out", type=Path, default=Path("runs/sweep"), help="the sweep's folder")
    p.add_argument("--python", default=sys.executable, help="the interpreter the jobs run pytest with")
    p.add_argument("--force", action="store_true", help="rerun every case, not only missing or failed ones")
    add_executor_options(p)
    return p


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # before any job was submitted (collecting the cases)
        print("sweep: interrupted by SIGINT before any job started", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = parser()
    args = p.parse_args(argv)
    check_outputs(p, {"--out": (args.out, True)})
    out = args.out.resolve()
    try:
        config = config_from_args(args, out / "jobs")
        local = _local_gpus(config)
    except ExecutorError as exc:
        p.error(str(exc))
    selection = [*args.bench_files, *(f"--only={o}" for o in args.only), *extra]
    if args.keyword:
        selection += ["-k", args.keyword]
    cwd = Path.cwd()
    try:
        node_ids = collect(args.python, selection, cwd)
    except SweepError as exc:
        print(f"sweep: {exc}", file=sys.stderr)
        return 2
    todo = [n for n in node_ids if args.force or not finished(out, n)]
    print(
        f"sweep: {len(node_ids)} case(s) selected, {len(node_ids) - len(todo)} done earlier, {len(todo)} to run"
    )
    if todo:
        print(f"sweep: {describe(config, todo)}", flush=True)
        try:
            _run(config, todo, out, args.python, cwd, extra, local)
        except ExecutorError as exc:  # sbatch refused the jobs: a partition or GRES the cluster lacks
            print(f"sweep: {exc}", file=sys.stderr)
            return 2
        except Interrupted as exc:
            (out / "sweep.json").write_text(json.dumps(merge(out, node_ids), indent=1))
            print(f"sweep: {exc.line('case(s)')}", file=sys.stderr)
            return exc.exit_code
    return _merged(out, node_ids)


def _merged(out: Path, node_ids: list[str]) -> int:
    """Write the merge; say which cases did not finish, and how to run them again."""
    merged = merge(out, node_ids)
    (out / "sweep.json").write_text(json.dumps(merged, indent=1))
    failed = [n for n in node_ids if unfinished(out, n)]
    for node_id in failed:
        status = case_files(out, node_id).read_status()
        print(f"{status.get('state')}: {node_id}: {status.get('error')}")
    print(f"sweep: {len(merged['benchmarks'])} row(s) in {out / 'sweep.json'}; {len(failed)} case(s) failed")
    if failed:
        print(f"sweep: rerun the same command to run the {len(failed)} failed case(s) again")
    return 1 if failed else 0


def _local_gpus(config: ExecutorConfig) -> LocalGpus | None:
    """On one machine, the GPUs the cases claim one job at a time (``None``: no GPUs asked for, or the
    scheduler hands them out)."""
    if config.resolved_kind() != "local" or not config.gpus_per_job:
        return None
    local = LocalGpus.seen(config.folder, local_gpu_count(), config.gpus_per_job)
    if local.per_job > local.total:
        raise ExecutorError(f"--gpus-per-job {local.per_job}: this machine has {local.total} GPU(s)")
    return local


def _run(
    config: ExecutorConfig,
    todo: list[str],
    out: Path,
    python: str,
    cwd: Path,
    extra: list[str],
    local: LocalGpus | None,
) -> None:
    # A job's pytest stops at the suite's own limit, before the scheduler's warning can end the job.
    timeout_s = config.work_limit_s()
    calls = {n: BenchCase(n, case_files(out, n).bench, python, cwd, extra, timeout_s, local) for n in todo}
    for node_id in todo:
        case_files(out, node_id).write_status(state="pending")

    def submitted(node_id: str, job_id: str) -> None:
        case_files(out, node_id).write_status(state="submitted", job_id=job_id)

    def ended(node_id: str, outcome: Outcome) -> None:  # as each job ends: an interruption keeps it
        files = case_files(out, node_id)
        files.write_status(**job_outcome(files.bench, outcome), job_id=outcome.job_id)

    run_jobs(config, calls, Watch(submitted=submitted, ended=ended))


if __name__ == "__main__":
    raise SystemExit(main())
