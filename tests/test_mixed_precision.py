"""D4: the accumulation probe (mixed_precision_accumulation) and the ToyModel under autocast
(benchmarking_mixed_precision (a))."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.profiling.mixed_precision import (
    ACCUMULATION_VARIANTS,
    accumulation_errors,
    accumulation_probe,
    toy_dtype_probe,
)


def test_accumulation_probe_orders_the_errors():
    values = accumulation_probe()
    errors = accumulation_errors()
    assert set(values) == set(ACCUMULATION_VARIANTS)
    # fp32 throughout is nearly exact; fp16 terms carry their representation error (0.01 is not exact
    # in fp16), whichever way they are upcast; an fp16 accumulator loses the increments' low bits once
    # the sum grows (spacing 2^-7 near 10), which is by far the worst.
    assert errors["fp32"] < 1e-3
    assert errors["fp32+=fp16"] == errors["fp32+=fp16.float()"]
    assert errors["fp32"] < errors["fp32+=fp16"] < 0.01 < errors["fp16"]
    assert values["fp16"] < 10  # rounding the sum to nearest in fp16 drops the increments' tails


def test_accumulation_probe_is_about_the_accumulator():
    # With a short sum the fp16 accumulator has not yet lost precision: same order, smaller gap.
    errors = accumulation_errors(n=10)
    assert errors["fp32"] <= errors["fp32+=fp16"] and errors["fp16"] < 1e-3


def _check_toy(dtypes: dict, low: torch.dtype, ln: torch.dtype) -> None:
    assert dtypes["params"] == torch.float32  # autocast casts copies for each op; parameters stay fp32
    assert dtypes["fc1"] == low  # linear runs in the low precision
    assert dtypes["ln"] == ln
    assert dtypes["logits"] == low
    assert dtypes["loss"] == torch.float32  # cross_entropy is on autocast's fp32 list
    assert dtypes["grads"] == torch.float32  # gradients take the parameters' dtype


def test_toy_model_bf16_autocast_on_cpu():
    # CPU autocast keeps layer_norm in the low precision (bf16 has fp32's exponent range).
    _check_toy(toy_dtype_probe("cpu", torch.bfloat16), low=torch.bfloat16, ln=torch.bfloat16)


@pytest.mark.gpu
def test_toy_model_fp16_autocast_on_gpu():
    # CUDA autocast runs layer_norm in fp32: its mean/variance reductions overflow or lose precision in fp16.
    _check_toy(toy_dtype_probe("cuda", torch.float16), low=torch.float16, ln=torch.float32)


@pytest.mark.gpu
def test_toy_model_bf16_autocast_on_gpu():
    # The CUDA policy does not depend on the low dtype: layer_norm still runs in fp32 under bf16.
    _check_toy(toy_dtype_probe("cuda", torch.bfloat16), low=torch.bfloat16, ln=torch.float32)
