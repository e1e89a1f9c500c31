"""The contract suite catches real bugs: run against an adapters file with one planted bug per hook
family (``tests/data/planted_*.py``), in a subprocess restricted by ``-k`` to that family (a few
seconds each), it must fail, naming the broken property, while the family's other checks pass."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "tests" / "data"

# adapters file -> (-k selection, text the failure must contain, text it must not contain, hook that fails)
PLANTED = {
    "planted_attention_causal_dk.py": (
        "test_matches_float64 and triton and causal and not gpu",
        "max |dK - ref|",
        "max |dQ - ref|",
        "get_flashattention_autograd_function_triton",
    ),
    "planted_ddp_summed.py": (
        "bucketed and ws2",
        "gradients summed, not averaged",
        "not broadcast",
        "ddp_bucketed_on_after_backward",
    ),
    "planted_sharded_every_param.py": (
        "test_sharded_optimizer and ws2 and sgd-groups",
        "each rank must hold only its shard's state",
        "max |weights - unsharded",
        "get_sharded_optimizer",
    ),
    "planted_fsdp_summed.py": (
        "test_fsdp and ws2 and fp32-sgd",
        "gradients summed, not averaged",
        "is not sharded",
        "fsdp_on_after_backward",
    ),
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("planted", PLANTED, ids=lambda f: f.removesuffix(".py").removeprefix("planted_"))
@pytest.mark.usefixtures("suite_self_check")
def test_contract_catches_planted_bug(planted: str) -> None:
    selection, expected, unexpected, hook = PLANTED[planted]
    cmd = [sys.executable, "-m", "pytest", "tests/contract", "--adapters", str(DATA / planted)]
    cmd += ["-k", selection, "-n", "0", "-p", "no:cacheprovider", "-q", "--no-header", "-W", "ignore"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTEST_XDIST_WORKER", None)
    run = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=280)
    out = run.stdout + run.stderr
    assert run.returncode == 1, f"expected failing tests (exit 1), got exit {run.returncode}:\n{out[-3000:]}"
    errors = "\n".join(line for line in out.splitlines() if line.startswith("E "))  # messages, not source
    assert expected in errors, f"no failure names the broken property ({expected!r}):\n{out[-3000:]}"
    assert unexpected not in errors, (
        f"a property the planted bug keeps was reported broken ({unexpected!r}):\n{out[-3000:]}"
    )
    summary = [line for line in out.splitlines() if line.startswith(hook + " ")]
    assert summary and "FAIL" in summary[0], f"the per-hook summary does not fail {hook}:\n{out[-3000:]}"
