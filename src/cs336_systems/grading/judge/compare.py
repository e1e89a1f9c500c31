"""The elementwise comparison every judge uses: ``|got - ref| <= atol + rtol * |ref|`` (the form of
``torch.testing.assert_close`` and ``torch.allclose``), in float64 so that the check adds no rounding.

A NaN is never within a bound, and neither is an inf where the reference is finite: every comparison
with a NaN is false, so the bound is tested as "within" and its negation counted, never as "outside"
(``diff > bound`` would let a NaN through). Equal values (an inf the reference also holds) are within."""

from __future__ import annotations

import torch

from ..shared.cases import Tolerance


def outside(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    """Where ``got`` is off ``ref`` by more than ``tol`` allows, or is NaN (a boolean tensor)."""
    got, ref = got.double(), ref.double()
    within = (got - ref).abs() <= tol.atol + tol.rtol * ref.abs()
    return ~(within | (got == ref))


def close(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> bool:
    return not bool(outside(got, ref, tol).any())


def max_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
