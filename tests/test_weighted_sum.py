"""D8: the Triton weighted-sum example against torch, forward and backward.

On a CPU-only machine the root conftest sets TRITON_INTERPRET=1 before this module imports the kernels,
so the same Triton code runs under the interpreter here and compiled on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels import weighted_sum as ws

# The Triton interpreter (numpy) warns about a deprecated scalar conversion on every launch.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")


def _rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm()).item()


def test_kernels_run_compiled_or_interpreted(device: torch.device) -> None:
    # Guard against a CI that silently skips the kernels: on CPU they must run under the interpreter.
    if device.type == "cpu":
        assert ws.INTERPRET, "TRITON_INTERPRET=1 must be set before import on a CPU-only machine"
        assert type(ws.weighted_sum_fwd).__name__ == "InterpretedFunction"
    else:
        assert type(ws.weighted_sum_fwd).__name__ == "JITFunction"


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((37, 24), torch.float32),  # rows not a multiple of the 16-row tile, D not a power of two
        ((3, 5, 64), torch.float32),  # leading dims are flattened and restored
        ((50, 130), torch.bfloat16),
    ],
    ids=["ragged-fp32", "3d-fp32", "ragged-bf16"],
)
def test_weighted_sum_matches_torch(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, generator: torch.Generator
) -> None:
    x = torch.randn(shape, generator=generator).to(device, dtype).requires_grad_()
    w = torch.randn(shape[-1], generator=generator).to(device, dtype).requires_grad_()
    g = torch.randn(shape[:-1], generator=generator).to(device, dtype)

    y = ws.weighted_sum(x, w)
    y.backward(g)

    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    y_ref = (w64 * x64).sum(-1)
    y_ref.backward(g.double())

    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y.shape == y_ref.shape and y.dtype == dtype
    assert _rel_err(y, y_ref) < tol
    assert _rel_err(x.grad, x64.grad) < tol
    assert _rel_err(w.grad, w64.grad) < tol


def test_weighted_sum_rejects_bad_input(device: torch.device) -> None:
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="weight of shape"):
        ws.weighted_sum(x, torch.randn(7, device=device))
    with pytest.raises(TypeError, match="bfloat16"):
        ws.weighted_sum(x, torch.randn(8, device=device, dtype=torch.bfloat16))


def test_weighted_sum_names_missing_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ws, "INTERPRET", False)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        ws.weighted_sum(torch.randn(4, 8), torch.randn(8))
