"""Planted bug, FSDP family: ``compute_dtype`` is accepted and ignored, so a low-precision run computes in
fp32 (a real repository's FSDP did this, and the course's fp16 test passes it at its own seed)."""

from __future__ import annotations

from tests.data.planted_common import SUITE, suite_hooks

globals().update(suite_hooks())


def get_fsdp(module, compute_dtype=None):
    return SUITE.get_fsdp(module, compute_dtype=None)
