"""Each rule of the case table is declared once: the judges and the workers read what a case checks from
its knobs, never from its tier; the leaderboard's case (shape, protocol) and the Triton hook's name live
in ``shared/cases.py`` alone, and everything else derives them from there."""

from __future__ import annotations

import ast
import dataclasses
import io
import tokenize
from collections.abc import Callable
from pathlib import Path

import torch

from cs336_systems.grading.judge import families, training
from cs336_systems.grading.shared.cases import (
    CASES,
    DDP_CHECKS,
    FSDP_CHECKS,
    LEADERBOARD_CASE,
    SHARDED_CHECKS,
    TIERS,
    TRITON_HOOK,
    Case,
    of_family,
)
from cs336_systems.grading.shared.models import make_model

ROOT = Path(__file__).resolve().parents[2]
GRADING = ROOT / "src" / "cs336_systems" / "grading"
CASES_PY = GRADING / "shared" / "cases.py"
SOURCES = sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "bench").rglob("*.py")])


def _code_tokens(path: Path) -> list[tokenize.TokenInfo]:
    """The file's tokens without comments and line breaks (a literal split over lines still reads as one)."""
    skip = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT}
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    return [t for t in tokens if t.type not in skip]


def _hook_literals(path: Path) -> list[int]:
    """Lines where a string literal is exactly the Triton hook's name (a docstring mentioning it is not)."""
    lines = []
    for tok in _code_tokens(path):
        if tok.type == tokenize.STRING and TRITON_HOOK in tok.string:
            try:
                if ast.literal_eval(tok.string) == TRITON_HOOK:
                    lines.append(tok.start[0])
            except (ValueError, SyntaxError):  # an f-string or bytes: not a plain spelling of the name
                continue
    return lines


def _shape_literals(path: Path) -> list[int]:
    """Lines where the leaderboard's shape is written as numbers in code: (heads, seq, d) or
    (heads, seq, seq, d) in a row, commas between."""
    numbers: list[tuple[int, int]] = []  # (value, line) of each run of numbers separated by commas
    runs: list[list[tuple[int, int]]] = []
    for tok in _code_tokens(path):
        if tok.type == tokenize.NUMBER and tok.string.isdigit():
            numbers.append((int(tok.string), tok.start[0]))
        elif not (tok.type == tokenize.OP and tok.string == ","):
            runs.append(numbers)
            numbers = []
    runs.append(numbers)
    wanted = [LEADERBOARD_CASE.shape, LEADERBOARD_CASE.attention_shape]
    lines = []
    for run in runs:
        values = tuple(v for v, _ in run)
        for shape in wanted:
            for i in range(len(values) - len(shape) + 1):
                if values[i : i + len(shape)] == shape:
                    lines.append(run[i][1])
    return lines


def _rep_literals(path: Path) -> list[int]:
    """Lines where the course's do_bench ``rep`` is a number in code (a ``rep`` keyword, field or key, or
    the default of a ``--rep`` option)."""
    tokens, lines = _code_tokens(path), []
    text = path.read_text().splitlines()
    for i, tok in enumerate(tokens):
        if tok.type != tokenize.NUMBER or tok.string != str(LEADERBOARD_CASE.rep_ms):
            continue
        # rep=N, rep_ms: int = N, or {"rep": N}
        names = {tokens[j].string.strip("\"'") for j in (i - 2, i - 4) if j >= 0}
        keyword = tokens[i - 1].string in ("=", ":") and bool(names & {"rep", "rep_ms"})
        if keyword or '"--rep"' in text[tok.start[0] - 1]:
            lines.append(tok.start[0])
    return lines


def _second_spellings(
    find: Callable[[Path], list[int]], needle: str, allowed: Callable[[Path], bool]
) -> list[str]:
    """``find``'s lines in every source file but the allowed ones; only files holding ``needle`` are
    tokenized (seconds, not tens of seconds, on a loaded machine)."""
    read = [(p, p.read_text()) for p in SOURCES if not allowed(p)]
    return [f"{p.relative_to(ROOT)}:{line}" for p, text in read if needle in text for line in find(p)]


def test_the_triton_hooks_name_is_spelled_only_in_the_case_table_and_adapters_files() -> None:
    assert _hook_literals(CASES_PY), "the scan no longer sees the table's own spelling"
    found = _second_spellings(
        _hook_literals, TRITON_HOOK, lambda p: p == CASES_PY or p.name.endswith("adapters.py")
    )
    assert not found, f"the Triton hook's name spelled again (use cases.TRITON_HOOK): {found}"


def test_the_leaderboard_case_is_declared_only_in_the_case_table() -> None:
    assert _shape_literals(CASES_PY) and _rep_literals(CASES_PY), "the scan no longer sees the table's own"
    shapes = _second_spellings(_shape_literals, str(LEADERBOARD_CASE.shape[1]), lambda p: p == CASES_PY)
    assert not shapes, f"the leaderboard's shape spelled again (use cases.LEADERBOARD_CASE): {shapes}"
    reps = _second_spellings(_rep_literals, str(LEADERBOARD_CASE.rep_ms), lambda p: p == CASES_PY)
    assert not reps, f"the leaderboard's do_bench rep spelled again (use cases.LEADERBOARD_CASE): {reps}"


def test_judges_and_workers_read_a_cases_knobs_not_its_tier() -> None:
    # the family judges of judge/ (its loop, session and summary select and report cases by tier)
    judges = [
        GRADING / "judge" / f"{name}.py"
        for name in ("attention", "compare", "families", "fsdp", "provenance", "training")
    ]
    readers = judges + [p for sub in ("worker", "shared") for p in (GRADING / sub).glob("*.py")]
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in readers
        if path != CASES_PY
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Attribute) and node.attr == "tier"
    ]
    assert not found, f"a rule decided by tier outside the case table (declare it as a knob): {found}"


def test_no_module_compares_a_tier_with_its_name_spelled_out() -> None:
    """A tier is compared through the table's constants or its ``TIERS`` record (``graded``,
    ``gates_rank``), never as a string: what a tier means is read from one place."""
    found = [
        f"{path.relative_to(ROOT)}:{node.lineno}"
        for path in sorted(GRADING.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Compare)
        for leaf in ast.walk(node)
        if isinstance(leaf, ast.Constant) and leaf.value in TIERS
    ]
    assert not found, f"a tier's name compared as a literal (use cases.COURSE, ..., or TIERS): {found}"


def test_every_data_parallel_case_declares_what_its_judge_checks() -> None:
    for family, checks in (("ddp", DDP_CHECKS), ("sharded", SHARDED_CHECKS), ("fsdp", FSDP_CHECKS)):
        for case in of_family(family):
            missing = [k for k in checks if k not in case.knobs]
            assert not missing, f"{case.id} does not say {missing}"


def _ddp_payloads(case: Case, inputs: dict, bent_rank: int | None) -> list[dict]:
    """Every rank returns the reference run; ``bent_rank``'s last parameters are off by 1e-3."""
    _, grads, params = training._reference_ddp(case, inputs, torch.device("cpu"))
    model = make_model(case.model, case.dtype, inputs["init"][0])
    after = [t.detach().clone() for t in (*model.parameters(), *model.buffers())]
    payloads = []
    for r in range(case.world_size):
        steps = [list(p) for p in params]
        if r == bent_rank:
            steps[-1] = [p + 1e-3 for p in steps[-1]]
        payloads.append({"result": {"after_wrap": after, "grads": grads, "params": steps}})
    return payloads


def test_the_ddp_judge_compares_the_ranks_the_case_names() -> None:
    """A rank other than 0 that ends off: caught where the case compares every rank (and asks that the
    ranks agree); let through, as the course does, where the same case says rank 0 only."""
    case = CASES["individual-beyond-ws3-toy-all-adamw"]
    inputs = families.make_inputs(case, 0)
    cpu = torch.device("cpu")
    assert training.judge_ddp(case, inputs, _ddp_payloads(case, inputs, None), cpu).status == "passed"
    bent = _ddp_payloads(case, inputs, 1)
    verdict = training.judge_ddp(case, inputs, bent, cpu)
    assert verdict.status == "failed" and "rank 1" in verdict.message, verdict
    rank0_only = dataclasses.replace(case, knobs={**case.knobs, "every_rank": False, "ranks_agree": False})
    assert training.judge_ddp(rank0_only, inputs, bent, cpu).status == "passed"
