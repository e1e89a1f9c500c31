"""The judging side, without workers: what a graded process writes is validated before use; a call
that raised is a failure unless the structured rules say skip; the table of cases is the course's; the
report's counts add up and only a course failure fails the run."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from cs336_systems.grading import exchange
from cs336_systems.grading.judge import attention, compare, families, summary, training
from cs336_systems.grading.judge.runner import Outcome
from cs336_systems.grading.judge.session import decide
from cs336_systems.grading.roots import GradingSetupError, discover
from cs336_systems.grading.shared.cases import (
    CASES,
    COURSE,
    COURSE_ATTENTION_SHAPE,
    LEADERBOARD,
    REFUSES_CPU,
    Tolerance,
)
from cs336_systems.grading.shared.models import make_model
from cs336_systems.grading.verdict import Verdict
from cs336_systems.grading.worker import outcome as worker_outcome

TOKEN = "a" * 32
TRITON_COURSE = "course-triton-match-b4-q128-k128-d64-causal-fp32-cuda"


def _record(tmp_path: Path, body: object, name: str = "case", rank: int = 0) -> Path:
    path = tmp_path / f"{name}.rank{rank}.pt"
    torch.save(body, path)
    return path


# -- what a graded process writes ----------------------------------------------------------------------


def test_a_record_must_come_from_this_run_and_this_case(tmp_path: Path) -> None:
    good = {"token": TOKEN, "case": "case", "rank": 0, "status": "done"}
    assert exchange.read_payload(_record(tmp_path, good), TOKEN, "case", 0)["status"] == "done"
    for body, why in (
        ({**good, "token": "b" * 32}, "token"),
        ({**good, "case": "other"}, "claims case"),
        (["not", "a", "dict"], "not the output record"),
    ):
        with pytest.raises(exchange.Untrusted, match=why):
            exchange.read_payload(_record(tmp_path, body), TOKEN, "case", 0)
    with pytest.raises(exchange.Untrusted, match="no output"):
        exchange.read_payload(tmp_path / "absent.rank0.pt", TOKEN, "absent", 0)


def test_a_record_without_a_token_or_for_another_rank_is_refused(tmp_path: Path) -> None:
    good = {"token": TOKEN, "case": "case", "rank": 1, "status": "done"}
    no_token = {k: v for k, v in good.items() if k != "token"}
    with pytest.raises(exchange.Untrusted, match="token"):
        exchange.read_payload(_record(tmp_path, no_token, rank=1), TOKEN, "case", 1)
    with pytest.raises(exchange.Untrusted, match="claims case 'case' rank 1"):
        exchange.read_payload(_record(tmp_path, good, rank=0), TOKEN, "case", 0)


def test_a_record_larger_than_the_limit_is_not_loaded(tmp_path: Path) -> None:
    path = _record(tmp_path, {"token": TOKEN, "case": "case", "rank": 0, "x": torch.zeros(256)})
    size = path.stat().st_size
    assert exchange.read_payload(path, TOKEN, "case", 0, max_bytes=size)["x"].numel() == 256
    with pytest.raises(exchange.Untrusted, match=f"is {size} bytes, more than"):
        exchange.read_payload(path, TOKEN, "case", 0, max_bytes=size - 1)


class Gadget:
    """Not a tensor or a plain container: a weights-only load refuses to build it."""


def test_a_record_that_needs_code_to_load_is_refused(tmp_path: Path) -> None:
    path = _record(tmp_path, {"token": TOKEN, "case": "case", "rank": 0, "x": Gadget()})
    with pytest.raises(exchange.Untrusted, match="does not load as plain tensors"):
        exchange.read_payload(path, TOKEN, "case", 0)


def test_tensors_are_checked_before_use() -> None:
    with pytest.raises(exchange.Untrusted, match="non-finite"):
        exchange.tensor(torch.tensor([1.0, math.nan]), "O")
    with pytest.raises(exchange.Untrusted, match="shape"):
        exchange.tensor(torch.zeros(2, 3), "O", (3, 2))
    with pytest.raises(exchange.Untrusted, match="missing"):
        exchange.tensor(None, "dQ")
    with pytest.raises(exchange.Untrusted, match="expected a list of 2"):
        exchange.tensors([torch.zeros(1)], "grads", [(1,), (1,)])


def test_a_saved_l_must_be_unique_as_the_course_finds_it() -> None:
    b, nq, nk, d = COURSE_ATTENTION_SHAPE
    case = CASES[TRITON_COURSE]
    out = {n: torch.zeros(b, n_, d) for n, n_ in (("O", nq), ("dQ", nq), ("dK", nk), ("dV", nk))}
    for candidates in ([], [torch.zeros(b, nq), torch.zeros(b, nq)]):
        result = {**out, "L": candidates, "saved_shapes": [[b, nq]] * len(candidates)}
        with pytest.raises(exchange.Untrusted, match="exactly one saved tensor"):
            attention._outputs(case, result, leaderboard=False)


# -- comparisons --------------------------------------------------------------------------------------

PYTORCH_COURSE = "course-pytorch-match-b4-q128-k128-d64-full-fp32-cpu"
NO_PROVENANCE = {"launched": [], "repository_kernels": {}, "operators": [], "kernels": []}


def test_a_nan_is_outside_every_bound_and_an_inf_outside_a_finite_reference() -> None:
    tol = Tolerance(1e-2, 1e-2)
    got = torch.tensor([math.nan, 1.0, math.inf, math.inf, -math.inf])
    ref = torch.tensor([1.0, 1.0, 1.0, math.inf, 1.0])
    assert compare.outside(got, ref, tol).tolist() == [True, False, True, False, True]
    assert not compare.close(torch.tensor([math.nan]), torch.tensor([math.nan]), Tolerance())


def _attention_outputs(case_id: str) -> tuple:
    """A course attention case's inputs and the exact outputs plain attention gives (a passing record)."""
    case = CASES[case_id]
    inputs = families.make_inputs(case, 0)
    qkv = [inputs[n] for n in ("q", "k", "v")]
    ref = attention.run_reference(qkv, inputs["dO"], False, torch.float32, torch.device("cpu"))
    b, nq = case.shape[:2]
    result = {n: ref[n] for n in ("O", "dQ", "dK", "dV")} | {"L": [ref["L"]], "saved_shapes": [[b, nq]]}
    return case, inputs, result


def test_the_attention_judge_fails_a_nan_in_o_on_its_own_and_through_the_comparison() -> None:
    case, inputs, result = _attention_outputs(PYTORCH_COURSE)
    cpu = torch.device("cpu")

    def judged() -> Verdict:
        return attention.judge(case, inputs, {"result": result, "provenance": NO_PROVENANCE}, [], cpu)

    assert judged().status == "passed"
    result["O"] = result["O"].clone()
    result["O"][0, 0, 0] = math.nan
    verdict = judged()
    assert verdict.status == "failed" and "O has 1 non-finite values" in verdict.message, verdict
    ref = attention.run_reference([inputs[n] for n in "qkv"], inputs["dO"], False, torch.float64, cpu)
    miss = attention._course_miss("O", result["O"], ref["O"], case.tolerance, "here")
    assert miss is not None and miss.startswith("O: 1 of"), miss


def test_the_beyond_bound_scales_with_the_reference_not_the_output() -> None:
    """1.01% off everywhere against a floor of 1% of max|ref| fails; scaled by the output's own
    maximum (1.0101 x max|ref|) the bound would let it through."""
    tol = Tolerance(plain_factor=10.0, floor=1e-2)
    ref = torch.randn(64, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    assert attention._relative_miss("O", ref * 1.009, ref, ref, tol, "here") is None
    miss = attention._relative_miss("O", ref * 1.0101, ref, ref, tol, "here")
    assert miss is not None and "> bound" in miss, miss


def test_ddp_course_checks_every_ranks_weights_after_wrapping() -> None:
    """A wrapper that does not broadcast leaves rank 1 with its own initial weights: the course
    compares every rank's with rank 0's, even when every step's parameters come out right."""
    case = CASES["ddp2026-course-ws2-course-toy-all-sgd"]
    inputs = families.make_inputs(case, 0)
    _, grads, params = training._reference_ddp(case, inputs, torch.device("cpu"))

    def rank(started_from: int) -> dict:
        model = make_model(case.model, case.dtype, inputs["init"][started_from])
        after = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
        return {"result": {"after_wrap": after, "grads": grads, "params": params}}

    cpu = torch.device("cpu")
    assert training.judge_ddp(case, inputs, [rank(0), rank(0)], cpu).status == "passed"
    verdict = training.judge_ddp(case, inputs, [rank(0), rank(1)], cpu)
    assert verdict.status == "failed" and "not broadcast from rank 0" in verdict.message, verdict
    assert "rank 1's" in verdict.message, verdict


# -- a call that raised ----------------------------------------------------------------------------------


def _raised(launched: list[list[str]], message: str = "AssertionError: q.is_cuda") -> dict:
    record = {"launched": launched, "repository_kernels": {}, "operators": [], "kernels": []}
    return {"status": "raised", "message": message, "provenance": record}


def test_a_refusal_of_cpu_tensors_is_a_raise_before_any_repository_kernel(tmp_path: Path) -> None:
    """On a CPU, a stand-in case whose call raised before launching a Triton kernel of the repository
    skips as a refusal; one that raised after launching one fails (its kernel ran and broke), and on a
    GPU nothing is a refusal."""
    case, roots = CASES[TRITON_COURSE], [tmp_path.resolve()]
    refused = attention.judge_raised(case, _raised([]), roots, on_gpu=False)
    assert refused.status == "skipped" and refused.kind == REFUSES_CPU
    kernel = [["flash_fwd", str(tmp_path / "cs336_systems" / "flash.py")]]
    broke = attention.judge_raised(case, _raised(kernel, "IndexError: out of range"), roots, on_gpu=False)
    assert broke.status == "failed" and "under Triton's CPU interpreter" in broke.message
    assert attention.judge_raised(case, _raised([]), roots, on_gpu=True).status == "failed"


def test_a_missing_dependency_is_an_error_of_the_grading_named_once(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "adapters.py").write_text("")
    roots = discover(tmp_path / "tests" / "adapters.py")
    record = {
        "status": "raised",
        "message": "ModuleNotFoundError: No module named 'einx'",
        "missing_dependency": "einx",
    }
    verdict = decide(CASES[TRITON_COURSE], {}, Outcome(records=[record]), roots, on_gpu=False)
    assert verdict.status == "error" and verdict.kind == "missing-dependency"
    assert verdict.message.startswith("cannot grade: needs einx") and "pip install einx" in verdict.message


def test_a_failure_inside_torch_names_the_students_line(tmp_path: Path) -> None:
    student = tmp_path / "cs336_systems"
    student.mkdir()
    (student / "bad.py").write_text(
        "import torch\n\n\ndef call():\n    return torch.einsum('ij,jk->ik', torch.ones(2, 2), torch.ones(2, 2, dtype=torch.float64))\n"
    )
    namespace: dict = {}
    exec(compile((student / "bad.py").read_text(), str(student / "bad.py"), "exec"), namespace)
    with pytest.raises(RuntimeError) as info:
        namespace["call"]()
    said = worker_outcome.describe(info.value, [str(tmp_path)])
    assert said["student_frame"] == f"{student / 'bad.py'}:5", said
    assert "torch" in said["innermost_frame"]


# -- the table of cases ------------------------------------------------------------------------------


def test_the_course_tier_is_what_the_course_runs() -> None:
    """The PyTorch hook on the CPU, not causal; the Triton hook on a GPU both ways (the interpreter
    stands in on a CPU); fp32 at the course's (4, 128, 128, 64); the leaderboard on a GPU only; every
    smaller length beyond, saying why; the data-parallel families at the course's placement."""
    attention_course = {c.id: c for c in CASES.values() if c.family == "attention" and c.tier == COURSE}
    assert {(c.knob("kind"), c.device, c.knob("causal")) for c in attention_course.values()} == {
        ("pytorch", "cpu", False),
        ("triton", "cuda", False),
        ("triton", "cuda", True),
    }
    assert all(c.shape == COURSE_ATTENTION_SHAPE and c.dtype == "fp32" for c in attention_course.values())
    assert all(
        c.knob("interpreter_stand_in") for c in attention_course.values() if c.knob("kind") == "triton"
    )
    leaderboard = [c for c in CASES.values() if c.tier == LEADERBOARD]
    assert leaderboard and all(c.device == "cuda" and not c.knob("interpreter_stand_in") for c in leaderboard)
    small = [c for c in CASES.values() if c.family == "attention" and min(c.shape[1:3]) < 128]
    assert all(c.tier != COURSE and c.why for c in small if c.knob("check") == "match")
    course_dp = [c for c in CASES.values() if c.family != "attention" and c.tier == COURSE]
    assert course_dp and all(c.device == "course" and c.world_size == 2 for c in course_dp)


def test_a_case_id_means_one_tolerance() -> None:
    ids = [c.id for c in CASES.values()]
    assert len(ids) == len(set(ids))
    for case in CASES.values():
        if case.family == "attention" and case.tier != COURSE:
            assert str(case.device) in case.id and case.tolerance.floor > 0


# -- the report --------------------------------------------------------------------------------------


def _case(tier: str, status: str, hook: str = "get_ddp", kind: str = "") -> dict:
    return {
        "id": f"{hook}-{tier}-{status}-{kind}",
        "tier": tier,
        "hooks": [hook, "ddp_on_after_backward"],
        "status": status,
        "kind": kind,
        "message": "m",
    }


def test_only_a_course_failure_or_an_error_fails_the_run_of_another_implementation() -> None:
    beyond_only = summary.build([_case("course", "passed"), _case("beyond", "failed")], 1, None)
    assert summary.exit_status(beyond_only, external=True, status=1) == 0
    course = summary.build([_case("course", "failed"), _case("beyond", "passed")], 1, None)
    assert summary.exit_status(course, external=True, status=1) == 1
    error = summary.build([_case("course", "error", kind="missing-dependency")], 1, None)
    assert summary.exit_status(error, external=True, status=1) == 1
    assert summary.exit_status(beyond_only, external=False, status=1) == 1


def test_the_table_counts_each_case_once_and_adds_up() -> None:
    cases = [
        _case("course", "passed"),
        _case("course", "skipped", kind="needs-gpu"),
        _case("beyond", "failed"),
        _case("course", "passed", hook="get_fsdp"),
        _case("leaderboard", "skipped", hook="get_fsdp", kind="needs-gpu"),
    ]
    report = summary.build(cases, 7, None)
    lines = summary.render(report)
    cells = [
        c for row in report["groups"].values() for t in ("course", "leaderboard", "beyond") for c in [row[t]]
    ]
    assert sum(sum(c.values()) for c in cells) == len(cases)
    assert lines[-1].startswith("5 cases: 2 passed, 1 failed, 2 skipped, 0 error"), lines[-1]
    assert "1/0/1" in lines[1] and "course ok; fails beyond" in lines[1], lines


# -- where the graded code is ----------------------------------------------------------------------------


def test_module_root_decides_where_the_package_is(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "adapters.py").write_text("")
    for folder in (tmp_path / "lib" / "cs336_systems", tmp_path / "cs336_systems"):
        folder.mkdir(parents=True)
    (tmp_path / "pyproject.toml").write_text('[tool.uv.build-backend]\nmodule-root = "lib"\n')
    assert discover(tmp_path / "tests" / "adapters.py").package_root == tmp_path / "lib"


def test_setup_errors_are_one_line_naming_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(GradingSetupError, match=r"holds no tests/adapters\.py"):
        discover(tmp_path)
    (tmp_path / "a.py").write_text("")
    with pytest.raises(GradingSetupError, match="--repo-root /nope: no such folder"):
        discover(tmp_path / "a.py", repo_root="/nope")
