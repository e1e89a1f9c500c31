"""Ways around a leaderboard's rules, each built on the honest kernel (``flash.py``) or on torch's own
attention. Written for the suite's grading tests; each must end up with no rank, naming what happened."""

import math
import os
import typing

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from cs336_systems import flash


class WrongButFast(torch.autograd.Function):
    """The honest forward and dQ, with dK and dV never computed: fast, and wrong."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        q, k, v = (t.contiguous() for t in (q, k, v))
        o, lse = flash.forward(q, k, v, bool(is_causal))
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.is_causal = bool(is_causal)
        return o

    @staticmethod
    def backward(ctx, d_o):
        q, k, v, o, lse = ctx.saved_tensors
        dq = flash.backward(q, k, v, o, lse, d_o, ctx.is_causal)[0]
        return dq, torch.zeros_like(k), torch.zeros_like(v), None


class SkipsEveryOther(torch.autograd.Function):
    """Computes every other call; the calls between hand back the last results again."""

    last = None
    calls = 0

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        SkipsEveryOther.calls += 1
        ctx.skip = SkipsEveryOther.calls % 2 == 0 and SkipsEveryOther.last is not None
        if ctx.skip:
            return SkipsEveryOther.last[0].clone()
        o = flash.FlashAttention.forward(ctx, q, k, v, is_causal)
        SkipsEveryOther.last = (o, None)
        return o

    @staticmethod
    def backward(ctx, d_o):
        if ctx.skip and SkipsEveryOther.last[1] is not None:
            return (*(g.clone() for g in SkipsEveryOther.last[1]), None)
        grads = flash.FlashAttention.backward(ctx, d_o)[:3]
        SkipsEveryOther.last = (SkipsEveryOther.last[0], grads)
        return (*grads, None)


class CachesByAddress(torch.autograd.Function):
    """Results kept by the inputs' addresses: a benchmark that calls again on the same tensors (the
    course's do_bench) gets them for free."""

    cache: typing.ClassVar[dict] = {}

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr(), tuple(q.shape), bool(is_causal))
        ctx.key = key
        if key in CachesByAddress.cache:
            return CachesByAddress.cache[key][0].clone()
        o = flash.FlashAttention.forward(ctx, q, k, v, is_causal)
        CachesByAddress.cache[key] = [o, None]
        return o

    @staticmethod
    def backward(ctx, d_o):
        entry = CachesByAddress.cache[ctx.key]
        if entry[1] is None:
            entry[1] = flash.FlashAttention.backward(ctx, d_o)[:3]
        return (*(g.clone() for g in entry[1]), None)


class Precomputed(torch.autograd.Function):
    """Work done before any clock: outputs for the inputs of a guessed seed, handed back for any inputs
    of that shape."""

    answers: typing.ClassVar[dict] = {}

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        key = (tuple(q.shape), q.device.type)
        if key not in Precomputed.answers:
            gen = torch.Generator(device=q.device).manual_seed(0)
            with torch.enable_grad():
                leaf = torch.randn((3, *q.shape), generator=gen, device=q.device, dtype=q.dtype)
                leaf.requires_grad_()
                o = flash.FlashAttention.apply(*leaf, is_causal)
                o.sum().backward()
            Precomputed.answers[key] = (o.detach(), leaf.grad)
        ctx.key = key
        return Precomputed.answers[key][0].clone()

    @staticmethod
    def backward(ctx, d_o):
        return (*(g.clone() for g in Precomputed.answers[ctx.key][1]), None)


@triton.jit
def token_lse_kernel(L, n: tl.constexpr):
    i = tl.arange(0, n)
    tl.store(L + i, tl.load(L + i) * 1.0)


def _token(lse: torch.Tensor) -> None:
    flat = lse.reshape(-1)
    token_lse_kernel[(1,)](flat, n=min(1024, triton.next_power_of_2(flat.numel()) // 2 or 1))


class BorrowedBehindToken(torch.autograd.Function):
    """torch's SDPA does the work; one Triton kernel of this repository touches L (a token)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            o = F.scaled_dot_product_attention(*(t[:, None] for t in leaves), is_causal=is_causal)[:, 0]
        scores = q.float() @ k.float().transpose(-1, -2) if q.shape[1] <= 1024 else None
        lse = (
            torch.logsumexp(scores / math.sqrt(q.shape[-1]), -1) if scores is not None else q[..., 0].float()
        )
        _token(lse)
        ctx.save_for_backward(lse)
        ctx.graph = (leaves, o)
        return o.detach()

    @staticmethod
    def backward(ctx, d_o):
        leaves, o = ctx.graph
        return (*torch.autograd.grad(o, leaves, d_o), None)


class MatmulsBehindToken(torch.autograd.Function):
    """Plain torch matmuls and softmax do the work (autograd's backward); a token Triton kernel."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        with torch.enable_grad():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            s = leaves[0] @ leaves[1].transpose(-1, -2) / math.sqrt(q.shape[-1])
            if is_causal:
                s = s + torch.full_like(s, -1e6).triu(1)
            lse = torch.logsumexp(s.float(), -1)
            o = torch.softmax(s, -1) @ leaves[2]
        _token(lse.detach())
        ctx.save_for_backward(lse.detach())
        ctx.graph = (leaves, o)
        return o.detach()

    @staticmethod
    def backward(ctx, d_o):
        leaves, o = ctx.graph
        return (*torch.autograd.grad(o, leaves, d_o), None)


def _watched() -> bool:
    """Whether anything observes this process: Nsight's injection (its environment, its library in the
    process's maps) or torch's profiler."""
    if any(k.startswith(("NV_NSIGHT", "NV_COMPUTE_PROFILER")) for k in os.environ):
        return True
    try:
        with open("/proc/self/maps") as f:
            if "Injection" in f.read():
                return True
    except OSError:
        pass
    enabled = getattr(torch._C._autograd, "_profiler_enabled", None)
    return bool(enabled and enabled())


class OwnKernelOnlyWhenWatched(torch.autograd.Function):
    """The honest kernel whenever something observes the process (the course tier's profiler, the
    leaderboard's Nsight Compute), torch's SDPA behind a token kernel otherwise (the timed run)."""

    @staticmethod
    def forward(ctx, q, k, v, is_causal=False):
        ctx.watched = _watched()
        impl = flash.FlashAttention if ctx.watched else BorrowedBehindToken
        return impl.forward(ctx, q, k, v, is_causal)

    @staticmethod
    def backward(ctx, d_o):
        impl = flash.FlashAttention if ctx.watched else BorrowedBehindToken
        return impl.backward(ctx, d_o)
