"""torch.compile traces FlashAttentionTriton into one graph: no graph break at the attention call.

A graph break there splits every block of a compiled model in two and leaves the attention call (and
dynamo's guards around it) to Python at every step; nothing else fails, the model just gets slower. On
2026-11-26 one did: the routing read torch's dispatch-mode stack while dynamo traced it, and the
compiled small model (ctx 512, bf16, H100) took 4x SDPA's step instead of 0.97x. ``fullgraph=True``
turns such a break into an error. Runs on the CPU under Triton's interpreter (the custom-op route) and
on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from cs336_systems.attention.flash_triton import FlashAttentionTriton


def _inputs(device: str, shape=(2, 2, 32, 16)) -> tuple[torch.Tensor, ...]:
    g = torch.Generator(device="cpu").manual_seed(0)
    return tuple(torch.randn(shape, generator=g).to(device).requires_grad_() for _ in range(3))


@pytest.mark.parametrize("causal", [False, True])
def test_compiled_apply_is_one_graph(device, causal: bool) -> None:
    torch._dynamo.reset()
    q, k, v = _inputs(device)
    compiled = torch.compile(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, causal), fullgraph=True)
    o = compiled(q, k, v)
    o.sum().backward()
    eager = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o_ref = FlashAttentionTriton.apply(*eager, causal)
    o_ref.sum().backward()
    assert torch.allclose(o, o_ref, atol=1e-5, rtol=1e-5)
    for t, t_ref in zip((q, k, v), eager, strict=True):
        assert torch.allclose(t.grad, t_ref.grad, atol=1e-4, rtol=1e-4)


class _Block(torch.nn.Module):
    """Attention between two projections on the model's layout: heads-major views of (batch, seq, heads,
    d) activations, as the Transformer block calls it."""

    def __init__(self, d_model: int = 32, heads: int = 2):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = torch.nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).unbind(2)
        o = FlashAttentionTriton.apply(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), True)
        return self.out(o.transpose(1, 2).reshape(b, n, d))


def test_compiled_block_is_one_graph(device) -> None:
    torch._dynamo.reset()
    torch.manual_seed(0)
    block = _Block().to(device)
    x = torch.randn(2, 32, 32, device=device)
    torch.compile(block, fullgraph=True)(x).square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in block.parameters())
