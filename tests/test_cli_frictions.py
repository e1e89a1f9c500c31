"""The benchmark CLI as a new user runs it on a CPU (issue 51): Triton pieces run under the interpreter
without setting anything, a context that does not fit is an OOM row (not a traceback), a failing case
is one line, ``--json`` into a missing folder says it created it, an output path that cannot be written
is one error line before anything runs (issue 57), and an interpreted row is marked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems.cli import benchmark as cli
from cs336_systems.harness import model_case  # cli.main imports its runner from here when it runs
from cs336_systems.profiling.timing import is_oom
from cs336_systems.rows.contention import INTERPRETER_NOTE

ROOT = Path(__file__).resolve().parents[1]

# A fresh process as a new user starts it (no TRITON_INTERPRET), its address space capped so that the
# out-of-memory case fails at once instead of pressing on a shared machine.
FRESH = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (12 << 30, 12 << 30))
from cs336_systems.cli import benchmark
status = benchmark.main(sys.argv[1:])
from cs336_systems.kernels import checks  # as the run imported it: after the CLI's own setting
print("INTERPRET", checks.INTERPRET)
sys.exit(status)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path: only without CUDA")
def test_fresh_cpu_process_interprets_triton_and_records_oom_as_a_row() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET" and not k.startswith("PYTEST_")}
    env["PYTHONPATH"] = str(ROOT / "src")
    args = [
        "--size",
        "tiny",
        "--context",
        "100000",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--no-mfu",
        "--no-progress",
    ]
    proc = subprocess.run(
        [sys.executable, "-c", FRESH, *args], env=env, capture_output=True, text=True, timeout=240, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "INTERPRET True" in proc.stdout  # --attention flash_triton / --fused-loss would run
    assert "| tiny-ctx100000-fp32-fwd_bwd-eager |        OOM |" in proc.stdout
    assert "Traceback" not in proc.stderr


def test_cpu_allocator_failure_is_out_of_memory() -> None:
    message = "[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried to allocate"
    assert is_oom(RuntimeError(message)) and not is_oom(RuntimeError("shape mismatch"))


def test_a_failing_case_is_one_line(monkeypatch, capsys) -> None:
    def broken(*args, **kwargs):
        raise ValueError("the Triton FlashAttention needs CUDA tensors\nsecond line\nthird")

    monkeypatch.setattr(model_case, "benchmark_model_case", broken)
    assert (
        cli.main(["--size", "tiny", "--context", "16", "--no-mfu", "--no-progress", "--device", "cpu"]) == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "error: case tiny-ctx16" in err and "needs CUDA tensors" in err


def test_json_into_a_missing_folder_says_it_created_it(tmp_path: Path, capsys) -> None:
    out = tmp_path / "new" / "rows.json"
    args = ["--size", "tiny", "--context", "16", "--warmup", "0", "--steps", "1", "--no-mfu", "--no-progress"]
    assert cli.main([*args, "--device", "cpu", "--json", str(out)]) == 0
    assert out.exists() and f"created the folder {out.parent} for --json" in capsys.readouterr().err


def test_an_interpreted_row_is_marked_not_shown(capsys) -> None:
    row = {"case": "tiny-flash_triton", "mean_ms": 90000.0, "contention": INTERPRETER_NOTE}
    assert cli._cells(row)[1] == "interpreted"
    cli.RowPrinter(case_width=20).row(row)
    out = capsys.readouterr().out
    assert "90000" not in out and "TRITON_INTERPRET=1" in out


def _bad_outputs(tmp_path: Path) -> list[tuple[str, str]]:
    """Output paths no run can write: under a file, and (where /proc exists) under /proc, which even
    root cannot add to although its permissions say otherwise."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    bad = [
        ("--json", f"{blocker}/out.json"),
        ("--profile", f"{blocker}/prof"),
        ("--memory-snapshot", f"{blocker}/m"),
    ]
    if Path("/proc").is_dir():
        bad += [("--json", "/proc/nope/out.json"), ("--profile", "/proc/nope")]
    return bad


def test_an_output_path_that_cannot_be_written_stops_the_run_before_it_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    ran = []
    monkeypatch.setattr(model_case, "benchmark_model_case", lambda *a, **k: ran.append(a) or {"mean_ms": 1.0})
    args = ["--size", "tiny", "--context", "16", "--no-mfu", "--no-progress", "--device", "cpu"]
    for flag, path in _bad_outputs(tmp_path):
        with pytest.raises(SystemExit) as exc:
            cli.main([*args, flag, path])
        err = capsys.readouterr().err
        assert exc.value.code == 2 and not ran, (flag, path)
        first, *rest = err.splitlines()
        assert first.startswith(f"python -m cs336_systems.cli.benchmark: error: {flag} {path}: "), err
        assert rest == ["(--help lists the options)"] and "Traceback" not in err
    assert cli.main([*args, "--json", str(tmp_path / "new" / "rows.json")]) == 0 and ran  # a good one runs


def test_unwritable_tells_files_from_folders(tmp_path: Path) -> None:
    from cs336_systems.cli.common import unwritable

    folder, file = tmp_path / "d", tmp_path / "f.json"
    folder.mkdir()
    file.write_text("{}")
    assert unwritable(folder) == "is a directory; give the file to write"
    assert unwritable(file, directory=True) == "is a file; it names a directory"
    assert unwritable(file) is None and unwritable(folder, directory=True) is None
    assert unwritable(tmp_path / "new" / "deeper" / "out.json") is None and not (tmp_path / "new").exists()
    assert list(folder.iterdir()) == []  # the probe leaves nothing behind


def test_a_withheld_figure_names_the_flag_that_prints_it(monkeypatch, capsys) -> None:
    """Issue 73: the CLI withheld a row timed under load without saying how to see its figures."""
    monkeypatch.setattr(cli, "row_verdict", lambda info: "load average 9.5 on 2 cores")
    args = ["--size", "tiny", "--context", "16", "--warmup", "0", "--steps", "1", "--no-mfu", "--no-progress"]
    assert cli.main([*args, "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "| unreliable |" in out and "load average 9.5 on 2 cores" in out
    assert "--show-unreliable prints its figures, marked *" in out
    assert cli.main([*args, "--device", "cpu", "--show-unreliable"]) == 0
    shown = capsys.readouterr().out
    assert "--show-unreliable" not in shown and "^ * unreliable timing: load average 9.5" in shown
    # an interpreted row says it too
    cli.RowPrinter(case_width=20).row({"case": "tiny-flash_triton", "contention": INTERPRETER_NOTE})
    assert "TRITON_INTERPRET=1" in (line := capsys.readouterr().out) and "--show-unreliable" in line
