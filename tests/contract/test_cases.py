"""Each tier's rules pinned as the course's tests and docs/grading.md state them, and every case of the
table built from its tier's record (``TIERS``): a rule changed in the record shows up here, by name, not
only as verdicts that differ somewhere downstream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cs336_systems.grading.shared.cases import (
    BEYOND,
    CASES,
    COURSE,
    COURSE_PLACEMENT,
    GRADED_TIERS,
    LEADERBOARD,
    LEADERBOARD_CASE,
    RANK_GATES,
    TIERS,
    Tolerance,
)
from cs336_systems.grading.shared.dtypes import DTYPES

# What each tier means, written out once more on purpose: the pin, not a second source.
PINNED = {
    # The course's tests: assert_close(rtol=1e-2, atol=1e-2) for attention; the data-parallel hooks where
    # the course places them, in fp32; test_fsdp.py's batch of 20; the course tier alone fails the run and
    # gates a leaderboard rank.
    COURSE: {
        "attention_tolerance": (0.01, 0.01, None),
        "stand_in": True,
        "trained_device": COURSE_PLACEMENT,
        "trained_dtype": "fp32",
        "fsdp_batch": 20,
        "state_checked": False,
        "graded": True,
        "gates_rank": True,
    },
    # Relative to plain PyTorch; a GPU's case, no interpreter stand-in; counts toward nothing.
    LEADERBOARD: {
        "attention_tolerance": None,
        "stand_in": False,
        "trained_device": "cpu",
        "trained_dtype": "fp64",
        "fsdp_batch": 6,
        "state_checked": True,
        "graded": False,
        "gates_rank": False,
    },
    # Float64 on the CPU, any mismatch a bug; each rank's FSDP state checked every step.
    BEYOND: {
        "attention_tolerance": None,
        "stand_in": True,
        "trained_device": "cpu",
        "trained_dtype": "fp64",
        "fsdp_batch": 6,
        "state_checked": True,
        "graded": False,
        "gates_rank": False,
    },
}


def _plain(value: object) -> object:
    """A tolerance as (atol, rtol, plain_factor), the rest of a record's fields as they are."""
    return (value.atol, value.rtol, value.plain_factor) if isinstance(value, Tolerance) else value


@pytest.mark.parametrize("tier", list(PINNED))
def test_each_tiers_rules_are_the_ones_the_course_and_docs_state(tier: str) -> None:
    rules = TIERS[tier]
    got = {name: _plain(getattr(rules, name)) for name in PINNED[tier]}
    assert got == PINNED[tier]
    assert {f.name for f in dataclasses.fields(rules)} == set(PINNED[tier]), "a rule not pinned here"


def test_the_tiers_in_their_order_and_what_counts() -> None:
    assert list(TIERS) == [COURSE, LEADERBOARD, BEYOND]  # the report's columns, in this order
    assert GRADED_TIERS == (COURSE,) and RANK_GATES == (COURSE,)


def test_every_case_is_built_from_its_tiers_record() -> None:
    for case in CASES.values():
        rules = TIERS[case.tier]
        if case.family == "attention":
            if rules.attention_tolerance is not None:
                assert case.tolerance == rules.attention_tolerance, case.id
            else:
                assert case.tolerance.plain_factor is not None, case.id
            if case.knob("interpreter_stand_in"):
                assert rules.stand_in, case.id
            continue
        assert case.device == rules.trained_device, case.id
        if case.family == "fsdp":
            assert case.knob("global_batch") == rules.fsdp_batch, case.id
            assert case.knob("state_checked") == rules.state_checked, case.id
        else:
            assert case.dtype == rules.trained_dtype, case.id


def test_the_leaderboard_cases_read_the_leaderboard_record() -> None:
    """The 2025 leaderboard's case: causal, bf16; every leaderboard case takes both from the record."""
    assert LEADERBOARD_CASE.causal is True and LEADERBOARD_CASE.dtype == "bf16"
    cases = [c for c in CASES.values() if c.tier == LEADERBOARD]
    assert cases
    for case in cases:
        assert (case.knob("causal"), case.dtype) == (LEADERBOARD_CASE.causal, LEADERBOARD_CASE.dtype), case.id


def test_the_shared_dtype_map_names_each_dtype_by_its_width() -> None:
    widths = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32, "fp64": torch.float64}
    assert widths == DTYPES
    used = {c.dtype for c in CASES.values()} | {LEADERBOARD_CASE.dtype}
    assert used <= set(DTYPES), f"a case's dtype the map does not name: {used - set(DTYPES)}"
