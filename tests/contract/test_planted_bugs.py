"""The contract catches real bugs: run against an adapters file with one planted bug per hook family,
in a subprocess restricted by ``-k`` to that family, it must fail the hook, naming the broken property,
while the family's other properties hold. The suite's own planted files (``tests/data/planted_*.py``)
start from the suite's hooks; ``students/src_layout/tests/adapters_dq_bug.py`` is a student-like
repository whose dQ is 1% off when n_queries != n_keys (fp32, on the CPU)."""

from __future__ import annotations

import pytest

from .grading_run import DATA, grade

# adapters file -> (-k selection, text a failure must contain, text none may contain, the failing hook)
PLANTED = {
    "planted_attention_causal_dk.py": (
        "test_attention and triton and causal and match and not gpu",
        "max |dK - float64|",
        "max |dQ - float64|",
        "get_flashattention_autograd_function_triton",
    ),
    "planted_ddp_summed.py": (
        "test_ddp and bucketed and ws2",
        "gradients summed, not averaged",
        "not broadcast",
        "ddp_bucketed_on_after_backward",
    ),
    "planted_sharded_every_param.py": (
        "test_sharded_optimizer and ws2",
        "each rank must hold only its shard's state",
        "max |weights - unsharded",
        "get_sharded_optimizer",
    ),
    "planted_fsdp_summed.py": (
        "test_fsdp and ws2 and fp32-sgd",
        "max |gathered",
        "is not sharded",
        "fsdp_on_after_backward",
    ),
    "students/src_layout/tests/adapters_dq_bug.py": (
        "test_attention and pytorch and match and fp32 and not gpu",
        "max |dQ - float64|",
        "max |dK - float64|",
        "get_flashattention_autograd_function_pytorch",
    ),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("planted", PLANTED, ids=lambda f: f.removesuffix(".py").replace("/", "-"))
@pytest.mark.usefixtures("suite_self_check")
def test_contract_catches_planted_bug(planted: str) -> None:
    selection, expected, unexpected, hook = PLANTED[planted]
    run = grade(DATA / planted, "-k", selection)
    failures = run.failures(hook)
    assert expected in failures, (
        f"no failure of {hook} names the broken property ({expected!r}):\n{run.output[-3000:]}"
    )
    assert unexpected not in failures, (
        f"a property the planted bug keeps was reported broken ({unexpected!r}):\n{failures}"
    )
    assert run.hooks[hook]["verdict"] != "ok", run.hooks[hook]
