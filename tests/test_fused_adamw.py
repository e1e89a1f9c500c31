"""FusedAdamW equals torch.optim.AdamW over several steps with weight decay: tensors that fill whole
blocks and tensors with ragged tails, unaligned views (as flat-buffer shards are), two parameter groups,
a parameter without a gradient; and bad input is refused."""

from __future__ import annotations

import pytest
import torch

from cs336_systems.kernels.fused_adamw import BLOCK, FusedAdamW

SHAPES = [(BLOCK,), (2 * BLOCK + 5,), (33, 17), (7,)]


def _params(device, gen, unaligned: bool = False) -> list[torch.Tensor]:
    params = [torch.randn(s, generator=gen).to(device) for s in SHAPES]
    if unaligned:  # a view one element into a flat buffer: 4-byte, not 16-byte, aligned
        flat = torch.randn(1 + BLOCK + 3, generator=gen).to(device)
        params.append(flat[1:])
    return params


def _copy(p: torch.Tensor) -> torch.Tensor:
    """A copy at the same offset into a buffer of its own, so views stay unaligned."""
    flat = torch.zeros(p.storage_offset() + p.numel(), device=p.device)
    flat[p.storage_offset() :] = p.flatten()
    return flat[p.storage_offset() :].view(p.shape)


def _run(opt_cls, params, grads, steps, **kw):
    ps = [torch.nn.Parameter(_copy(p)) for p in params]
    groups = [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]
    opt = opt_cls(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kw)
    for step in range(steps):
        for p, g in zip(ps, grads[step], strict=True):
            p.grad = g.clone() if g is not None else None
        opt.step()
    return ps, opt


@pytest.mark.parametrize("unaligned", [False, True])
def test_matches_torch_adamw(device, generator, unaligned: bool) -> None:
    params = _params(device, generator, unaligned)
    steps = 4
    grads = [[torch.randn(p.shape, generator=generator).to(device) for p in params] for _ in range(steps)]
    for g in grads[1:3]:
        g[3] = None  # a parameter without a gradient for two steps keeps its state and step count
    ours, opt = _run(FusedAdamW, params, grads, steps)
    assert (ours[-1].data_ptr() % 16 != 0) == unaligned
    ref, ref_opt = _run(torch.optim.AdamW, params, grads, steps)
    for a, b in zip(ours, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            opt.state[a]["exp_avg_sq"], ref_opt.state[b]["exp_avg_sq"], rtol=1e-6, atol=1e-9
        )
    assert opt.state[ours[3]]["step"] == 2 and opt.state[ours[0]]["step"] == steps


def test_unaligned_view_updates_in_place(device, generator) -> None:
    flat = torch.randn(1 + 2 * BLOCK, generator=generator).to(device)
    shard = torch.nn.Parameter(flat[1:])
    before = flat.clone()
    shard.grad = torch.randn(shard.shape, generator=generator).to(device)
    FusedAdamW([shard], lr=0.1).step()
    assert torch.equal(flat[0], before[0])  # the element before the view is untouched
    assert (flat[1:] != before[1:]).all()


def test_bad_input(device) -> None:
    p = torch.nn.Parameter(torch.randn(4, 4, device=device, dtype=torch.bfloat16))
    p.grad = torch.randn_like(p)
    with pytest.raises(TypeError, match="float32"):
        FusedAdamW([p]).step()
    q = torch.nn.Parameter(torch.randn(4, 4, device=device).t())
    q.grad = torch.randn(4, 4, device=device)
    with pytest.raises(ValueError, match="contiguous"):
        FusedAdamW([q]).step()
    with pytest.raises(ValueError, match="betas"):
        FusedAdamW([q], betas=(0.9, 1.0))


@pytest.mark.gpu
def test_gpu_matches_fused_and_foreach(generator) -> None:
    device = torch.device("cuda")
    params = [*_params(device, generator), torch.randn(1000, 1000, generator=generator).to(device)]
    grads = [[torch.randn(p.shape, generator=generator).to(device) for p in params] for _ in range(5)]
    ours, _ = _run(FusedAdamW, params, grads, 5)
    for kw in ({"fused": True}, {"foreach": True}):
        ref, _ = _run(torch.optim.AdamW, params, grads, 5, **kw)
        for a, b in zip(ours, ref, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
