"""The elementwise comparison every judge uses: ``|got - ref| <= atol + rtol * |ref|`` (the form of
``torch.testing.assert_close`` and ``torch.allclose``), in float64 so that the check adds no rounding."""

from __future__ import annotations

import torch

from ..worker.cases import Tolerance


def outside(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> torch.Tensor:
    """Where ``got`` is off ``ref`` by more than ``tol`` allows (a boolean tensor)."""
    return (got.double() - ref.double()).abs() > tol.atol + tol.rtol * ref.double().abs()


def close(got: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> bool:
    return not bool(outside(got, ref, tol).any())


def max_diff(got: torch.Tensor, ref: torch.Tensor) -> float:
    return (got.double() - ref.double()).abs().max().item() if got.numel() else 0.0
