"""kernels/flash/analysis_memo.py: torch's mutation analysis of our traced kernels runs once per signature.

CPU tests drive the memo with a stand-in analysis (torch's needs a GPU to build TTIR); the GPU test counts
the real analysis while a compiled function calls attention at several sites.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels.flash.analysis_memo import AnalysisMemo, memoize_analysis, signature


class Kernel:
    """A stand-in for a JITFunction (hashable by identity)."""


def stand_in_torch() -> tuple[types.ModuleType, list]:
    """A module with torch 2.11's analysis name; the list records each real analysis."""
    calls: list = []

    def identify_mutated_tensors(kernel, kwargs, tma_metadata):
        calls.append((kernel, dict(kwargs)))
        return [name for name, v in kwargs.items() if isinstance(v, torch.Tensor) and name.startswith("out")]

    return types.SimpleNamespace(identify_mutated_tensors=identify_mutated_tensors), calls


def launch_args(n: int, causal: bool, dtype=torch.float32) -> dict:
    return {
        "q": torch.empty(2, n, dtype=dtype),
        "out": torch.empty(2, n, dtype=dtype),
        "N": n,
        "CAUSAL": causal,
    }


def test_one_analysis_per_signature_and_copies_of_the_answer() -> None:
    module, calls = stand_in_torch()
    ours, theirs = Kernel(), Kernel()
    memo = memoize_analysis({ours}, module)
    assert isinstance(module.identify_mutated_tensors, AnalysisMemo)
    first = module.identify_mutated_tensors(ours, launch_args(64, True), {})
    # Other tensors of the same dtype at another call site: the answer is kept.
    again = module.identify_mutated_tensors(ours, launch_args(64, True), {})
    assert first == again == ["out"] and len(calls) == 1 and (memo.hits, memo.misses) == (1, 1)
    again.append("q")  # a caller's change to its answer does not reach the memo
    assert module.identify_mutated_tensors(ours, launch_args(64, True), {}) == ["out"]
    # A constexpr, a scalar, a dtype or the TMA metadata changes the signature: analysed again.
    module.identify_mutated_tensors(ours, launch_args(64, False), {})
    module.identify_mutated_tensors(ours, launch_args(128, True), {})
    module.identify_mutated_tensors(ours, launch_args(64, True, torch.bfloat16), {})
    module.identify_mutated_tensors(ours, launch_args(64, True), {"q": ("stable", [64])})
    assert len(calls) == 5 and memo.misses == 5
    # Kernels that are not ours are analysed at every call.
    for _ in range(2):
        module.identify_mutated_tensors(theirs, launch_args(64, True), {})
    assert len(calls) == 7


def test_installs_once_and_adds_kernels(monkeypatch) -> None:
    module, _ = stand_in_torch()
    # A module that imported the analysis by name (as `from ... import identify_mutated_tensors`) gets the
    # memo too.
    holder = types.ModuleType("imported_by_name")
    holder.identify_mutated_tensors = module.identify_mutated_tensors
    monkeypatch.setitem(sys.modules, holder.__name__, holder)
    a, b = Kernel(), Kernel()
    memo = memoize_analysis({a}, module)
    assert holder.identify_mutated_tensors is memo
    assert memoize_analysis({b}, module) is memo and memo.names == {id(a), id(b)}
    assert memoize_analysis({a}, types.SimpleNamespace()) is None  # no analysis by a known name


def test_signature_reads_dtype_from_inductor_buffers() -> None:
    class Buffer:  # inductor's TensorBox answers get_dtype()
        def __init__(self, dtype):
            self.dtype = dtype

        def get_dtype(self):
            return self.dtype

    kernel = Kernel()
    same = signature(kernel, {"x": Buffer(torch.float16)}, ())
    assert same == signature(kernel, {"x": Buffer(torch.float16)}, ())
    assert same != signature(kernel, {"x": Buffer(torch.float32)}, ())


@pytest.mark.gpu
def test_compiled_call_sites_share_one_analysis_per_kernel(device, generator) -> None:
    # Four attention calls in one compiled function (as four layers): without the memo torch analyses
    # each kernel at each call site in each pass; with it, once per kernel and signature.
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 256, 64, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))

    def layers(q, k, v):
        for _ in range(4):
            q = FlashAttentionTriton.apply(q, k, v, True)
        return q

    memo = memoize_analysis(())
    assert memo is not None, "this torch has no mutation analysis by a known name"
    hits, misses = memo.hits, memo.misses
    torch.compile(layers)(q, k, v).sum().backward()
    hits, misses = memo.hits - hits, memo.misses - misses
    # 12 call sites (4 forward, 8 backward), analysed in each of several passes; a few signatures (three
    # kernels; a layer's input and output strides may differ).
    assert misses <= 8 and hits >= 3 * misses, (misses, hits)
    torch._dynamo.reset()
