"""The contract catches real bugs: against an adapters file with one planted bug per hook family, the
chosen cases fail, naming the broken property, while the family's other properties hold. The suite's
own planted files (``tests/data/planted_*.py``) start from the suite's hooks;
``students/src_layout/tests/adapters_dq_bug.py`` is a student-like repository whose dQ is 1% off when
n_queries != n_keys (fp32, on the CPU)."""

from __future__ import annotations

import pytest

from cs336_systems.grading.shared.cases import CASES
from cs336_systems.grading.verdict import FAILED

from .grading_run import DATA, verdicts


def _ids(family: str, *parts: str) -> list[str]:
    return [c.id for c in CASES.values() if c.family == family and all(p in c.id for p in parts)]


# adapters file -> (cases, text every failure contains, text none contains)
PLANTED = {
    "planted_attention_causal_dk.py": (_ids("attention", "course-triton", "causal"), "dK:", "dQ:"),
    "planted_ddp_summed.py": (
        _ids("ddp", "bucketed-course", "toy", "0.0016MB"),
        "gradients summed, not averaged",
        "not broadcast",
    ),
    "planted_sharded_every_param.py": (
        _ids("sharded", "beyond-ws2", "one-group"),
        "each rank must hold only its shard's state",
        "max |",
    ),
    "planted_fsdp_summed.py": (_ids("fsdp", "course-train", "fp32"), "max |gathered", "is not sharded"),
    "planted_fsdp_fp32_compute.py": (
        _ids("fsdp", "beyond-train-ws2-fp16"),
        "compute_dtype is not used",
        "max |gathered",
    ),
    "students/src_layout/tests/adapters_dq_bug.py": (
        _ids("attention", "beyond-pytorch-match-b2-q45-k83", "fp32"),
        "max |dQ - float64|",
        "max |dK",
    ),
}


@pytest.mark.timeout(420)
@pytest.mark.parametrize("planted", PLANTED, ids=lambda f: f.removesuffix(".py").replace("/", "-"))
@pytest.mark.usefixtures("suite_self_check")
def test_contract_catches_planted_bug(planted: str) -> None:
    cases, expected, unexpected = PLANTED[planted]
    assert cases, "the selection names no case"
    for case_id, verdict in verdicts(DATA / planted, cases).items():
        assert verdict.status == FAILED and expected in verdict.message, (case_id, verdict)
        assert unexpected not in verdict.message, (
            f"a property the bug keeps was reported broken: {verdict.message}"
        )
