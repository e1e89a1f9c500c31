"""Launches: one kernel call's arguments (:class:`Launch`), built by :func:`fwd_launch`, :func:`dq_launch`,
:func:`dkdv_launch` and :func:`one_pass_launches` for a config as :func:`select.resolve` left it (its
flags say which kernel: Gluon, warp-specialized, one-pass, Triton with or without descriptors; no gate
here), and :class:`KernelPlan`, a launch compiled once for a call signature and replayed at the cost of
the launcher's C call.

Every kernel takes (batch, heads, seq, d) tensors of any strides and a grid (tiles, batch * heads), so no
input is copied.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from . import compat
from .configs import TileConfig, bucket
from .gluon_bwd import flash_bwd_dkdv_gluon_kernel, flash_bwd_dq_gluon_kernel
from .gluon_fwd import flash_fwd_gluon_kernel
from .gluon_ws_bwd import flash_bwd_dkdv_ws_kernel, flash_bwd_dq_ws_kernel
from .gluon_ws_fwd import flash_fwd_ws_kernel
from .gluon_ws_one_pass import flash_bwd_one_pass_ws_kernel
from .select import seq_major
from .triton_bwd import flash_bwd_delta_kernel, flash_bwd_dkdv_kernel, flash_bwd_dq_kernel
from .triton_fwd import flash_fwd_kernel


@dataclass(frozen=True)
class Launch:
    """One kernel launch: leading tensors (or tensor descriptors), then integers and the scale, then the
    constexprs by name, in the kernel's parameter order."""

    fn: Any
    grid: tuple[int, int]
    args: tuple
    constexprs: dict[str, Any]
    config: TileConfig

    def jit(self) -> Any:
        """Launch through Triton's JIT (compiling on first use); the compiled kernel (None when
        interpreted)."""
        c = self.config
        return self.fn[self.grid](
            *self.args, **self.constexprs, num_warps=c.num_warps, num_stages=c.num_stages
        )

    def warmup(self) -> None:
        """Compile without launching (under AsyncCompileMode: submit the compile and return)."""
        c = self.config
        self.fn.warmup(
            *self.args, grid=self.grid, **self.constexprs, num_warps=c.num_warps, num_stages=c.num_stages
        )


def _rows(t: torch.Tensor, rows: int, use_tma: bool):
    """What a Triton kernel gets for a (batch, heads, N, d) tensor: a descriptor of [1, 1, rows, BLOCK_D]
    boxes, or the tensor itself."""
    if not use_tma:
        return t
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, bucket(t.shape[3])])


def _tiles(c: TileConfig, d: int, is_causal: bool, tma: bool) -> dict[str, Any]:
    """The trailing constexprs of the Triton kernels."""
    return dict(
        D=d, Q_TILE_SIZE=c.q_tile, K_TILE_SIZE=c.k_tile, is_causal=is_causal, BLOCK_D=bucket(d), USE_TMA=tma
    )


def _gluon_constexprs(
    c: TileConfig, d: int, is_causal: bool, major: int | None, ring: bool = True
) -> dict[str, Any]:
    """The Gluon kernels' constexprs, in their parameter order (a plan passes them by position): STAGES,
    the depth of a tile ring; SEQ_MAJOR, for the kernels that read either layout, which tensors are
    seq-major (bit i: Q, K, V, dO, then the gradients)."""
    constexprs = dict(D=d, BM=c.q_tile, BN=c.k_tile, is_causal=is_causal, WARPS=c.num_warps)
    if ring:
        constexprs["STAGES"] = c.num_stages
    if major is not None:
        constexprs["SEQ_MAJOR"] = major
    return constexprs


def fwd_launch(c: TileConfig, is_causal: bool, q, k, v, o, lse) -> Launch:
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    if c.gluon:
        descs, major = _gluon_rows((q, c.q_tile), (k, c.k_tile), (v, c.k_tile))
        args = (*descs, o, lse, *_o_strides(o), *_tail(q, k))
        fn = flash_fwd_ws_kernel if c.ws else flash_fwd_gluon_kernel
        constexprs = _gluon_constexprs(c, d, is_causal, major if c.ws else None)
        return Launch(fn, (n_q // c.q_tile, batch * heads), args, constexprs, c)
    tma = c.tma
    args = (
        _rows(q, c.q_tile, tma), _rows(k, c.k_tile, tma), _rows(v, c.k_tile, tma), _rows(o, c.q_tile, tma), lse,
        *q.stride(), *k.stride(), *v.stride(), *o.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    return Launch(
        flash_fwd_kernel, (-(-n_q // c.q_tile), batch * heads), args, _tiles(c, d, is_causal, tma), c
    )


def dq_launch(c: TileConfig, is_causal: bool, q, k, v, o, do, lse, delta, dq) -> Launch:
    """The dQ pass, which also writes D = rowsum(dO ∘ O) into ``delta``."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    qt, kt = c.q_tile, c.k_tile
    if c.gluon:
        (q_d, k_d, v_d, do_d), major = _gluon_rows((q, qt), (k, kt), (v, kt), (do, qt))
        major |= bool(seq_major(dq)) << 4
        args = (q_d, k_d, v_d, o, do_d, lse, delta, dq, *_o_strides(o), *_tail(q, k))
        fn = flash_bwd_dq_ws_kernel if c.ws else flash_bwd_dq_gluon_kernel
        constexprs = _gluon_constexprs(c, d, is_causal, major if c.ws else None)
        return Launch(fn, (n_q // qt, batch * heads), args, constexprs, c)
    tma = c.tma
    args = (
        _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), o, _rows(do, qt, tma), lse, delta,
        _rows(dq, qt, tma),
        *q.stride(), *k.stride(), *v.stride(), *o.stride(), *do.stride(), *dq.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    return Launch(flash_bwd_dq_kernel, (-(-n_q // qt), batch * heads), args, _tiles(c, d, is_causal, tma), c)


def dkdv_launch(c: TileConfig, is_causal: bool, q, k, v, do, lse, delta, dk, dv) -> Launch:
    """The dK/dV pass, reading the D that the dQ pass wrote."""
    batch, heads, n_q, d = q.shape
    n_k = k.shape[2]
    qt, kt = c.q_tile, c.k_tile
    if c.gluon:
        vector = lambda t: _gluon_descriptor(t, [qt])  # L and D, by the copy engine too
        descs, major = _gluon_rows((q, qt), (k, kt), (v, kt), (do, qt))
        major |= bool(seq_major(dk)) << 4 | bool(seq_major(dv)) << 5
        args = (*descs, vector(lse), vector(delta), dk, dv, heads, *_tail(q, k))
        # (the non-specialized dK/dV pass's query ring has a fixed depth)
        constexprs = _gluon_constexprs(c, d, is_causal, major, ring=c.ws)
        fn = flash_bwd_dkdv_ws_kernel if c.ws else flash_bwd_dkdv_gluon_kernel
        return Launch(fn, (n_k // kt, batch * heads), args, constexprs, c)
    tma = c.tma
    args = (
        _rows(q, qt, tma), _rows(k, kt, tma), _rows(v, kt, tma), _rows(do, qt, tma), lse, delta,
        _rows(dk, kt, tma), _rows(dv, kt, tma),
        *q.stride(), *k.stride(), *v.stride(), *do.stride(), *dk.stride(), *dv.stride(),
        heads, n_q, n_k, 1.0 / math.sqrt(d),
    )  # fmt: skip
    return Launch(
        flash_bwd_dkdv_kernel, (-(-n_k // kt), batch * heads), args, _tiles(c, d, is_causal, tma), c
    )


def one_pass_launches(
    c: TileConfig, is_causal: bool, q, k, v, o, do, lse, delta, dk, dv, dq_acc
) -> list[Launch]:
    """The one-pass backward's launches: D and the zeroed float32 dQ
    accumulator ``dq_acc`` ([batch * heads * n_q, d]), then the kernel, which writes dK and dV and adds dQ
    (scaled) into ``dq_acc``."""
    batch, heads, n_q, d = q.shape
    delta_args = (o, do, delta, dq_acc, *o.stride(), *do.stride(), heads, n_q)
    pre = Launch(
        flash_bwd_delta_kernel, (n_q // c.q_tile, batch * heads), delta_args, dict(D=d, ROWS=c.q_tile), c
    )
    split = dkdv_launch(c, is_causal, q, k, v, do, lse, delta, dk, dv)  # the same leading arguments
    acc = _gluon_descriptor(dq_acc, [c.q_tile, d // 2], list(dq_acc.shape), [d, 1])
    args = (*split.args[:8], acc, *split.args[8:])
    return [pre, Launch(flash_bwd_one_pass_ws_kernel, split.grid, args, split.constexprs, c)]


# ----------------------------------------------------------------------------------------------------------
# The Gluon kernels' descriptors
# ----------------------------------------------------------------------------------------------------------


def _gluon_descriptor(
    base: torch.Tensor, box: list[int], shape: list[int] | None = None, strides: list[int] | None = None
) -> GluonTensorDescriptor:
    """A descriptor of ``box``-shaped tiles over ``base`` (a contiguous vector unless ``shape`` and
    ``strides`` say otherwise), with the default swizzle for them."""
    dtype = {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16, torch.float32: gl.float32}[base.dtype]
    layout = gl.NVMMASharedLayout.get_default_for(box, dtype)
    return GluonTensorDescriptor(base, shape or [base.numel()], strides or [1], box, layout)


def _head_rows(t: torch.Tensor, tile: int) -> tuple[GluonTensorDescriptor, bool]:
    """[tile, d] boxes over ``t``'s rows in its layout (:func:`select.seq_major`), and that layout."""
    b, h, n, d = t.shape
    major = bool(seq_major(t))
    shape = [b * n, h * d] if major else [b * h * n, d]
    return _gluon_descriptor(t, [tile, d], shape, [t.stride(2), 1]), major


def _gluon_rows(*tensors: tuple[torch.Tensor, int]) -> tuple[list[GluonTensorDescriptor], int]:
    """[tile, d] boxes over the rows of each (batch, heads, seq, d) tensor, and which are seq-major (bit i
    for the i-th tensor)."""
    rows = [_head_rows(t, tile) for t, tile in tensors]
    return [desc for desc, _ in rows], sum(major << i for i, (_, major) in enumerate(rows))


def _tail(q: torch.Tensor, k: torch.Tensor) -> tuple:
    """The Gluon kernels' trailing arguments: N_QUERIES, N_KEYS and the softmax scale."""
    return q.shape[2], k.shape[2], 1.0 / math.sqrt(q.shape[3])


def _o_strides(o: torch.Tensor) -> tuple:
    """O's batch, head and row strides, then the number of heads."""
    return o.stride(0), o.stride(1), o.stride(2), o.shape[1]


# ----------------------------------------------------------------------------------------------------------
# A launch compiled for one call signature
# ----------------------------------------------------------------------------------------------------------


INTERPRETED = "Triton's JIT: interpreted (TRITON_INTERPRET=1), no compiled kernel to launch"


class KernelPlan:
    """One kernel compiled for one call signature (shapes, strides, dtypes, alignment, config): a launch
    hands only the call's device addresses (and descriptors) to the compiled kernel's launcher. Triton's JIT
    dispatch would bind and specialize ~40 arguments and build a cache key per launch, which costs more
    host time than the launch itself; the model launches attention kernels 3 x layers times per step.

    ``fallbacks``: why this plan launches through Triton's own launcher or JIT instead of the launcher's C
    entry point with tensor maps kept per address (empty when it does not); the attention plan records
    them with the pass (``flash.launched``)."""

    __slots__ = (
        "boxes",
        "encoded",
        "fallbacks",
        "grid",
        "launch",
        "launch_jit",
        "prefix",
        "tail",
        "tma_meta",
    )

    def __init__(self, call: Launch):
        """Launches ``call`` once through the JIT (compiling it) and keeps what later launches reuse."""
        descriptors = (TensorDescriptor, GluonTensorDescriptor)
        n = next(i for i, a in enumerate(call.args) if not isinstance(a, (torch.Tensor, *descriptors)))
        boxes = tuple(
            (a.shape, a.strides, a.block_shape) if isinstance(a, descriptors) else None for a in call.args[:n]
        )
        self.boxes = boxes if any(boxes) else None
        self.tail = (*call.args[n:], *call.constexprs.values())
        self.grid = call.grid
        compiled = call.jit()  # None under the interpreter, which always goes through the JIT
        self.launch_jit, self.launch, self.prefix, self.tma_meta, self.encoded = None, None, (), None, ()
        if compiled is None:
            c = call.config
            self.launch_jit = functools.partial(
                call.fn[call.grid], num_warps=c.num_warps, num_stages=c.num_stages
            )
            fallback = INTERPRETED
        else:
            # Descriptors: Triton's launcher encodes each into a CUDA tensor map on the host
            # (``cuTensorMapEncodeTiled``) on every launch, a few microseconds each, up to four per launch.
            # A map depends only on the address once the plan fixed the layout, and a training loop's
            # caching allocator hands the same addresses back step after step, so maps are kept per
            # address (``encoded``) and handed to the launcher under that wrapper ready-made.
            self.launch, self.prefix, self.tma_meta, fallback = compat.kernel_launcher(
                compiled, descriptors=self.boxes is not None
            )
            self.encoded = tuple({} for _ in self.tma_meta or ())
        self.fallbacks = () if fallback is None else (f"{call.fn.__name__}: {fallback}",)

    def _encode(self, slot: int, t: torch.Tensor, box: tuple) -> list:
        """The launcher arguments of descriptor ``slot`` for ``t``: its tensor map, shape and strides."""
        cache = self.encoded[slot]
        if len(cache) >= 64:  # addresses a long run no longer uses
            cache.clear()
        desc = compat.unchecked_descriptor(t, box)
        args = cache[t.data_ptr()] = compat.encode_descriptor(desc, self.tma_meta[slot])
        return args

    def __call__(self, stream: int, *tensors: torch.Tensor) -> None:
        if self.launch_jit is not None:
            if self.boxes is not None:
                tensors = tuple(
                    t if b is None else compat.unchecked_descriptor(t, b)
                    for t, b in zip(tensors, self.boxes, strict=True)
                )
            self.launch_jit(*tensors, *self.tail)
            return
        # Device addresses as integers: given a tensor, the launcher calls its data_ptr() and then
        # cuPointerGetAttribute to check the address, per tensor and launch (the plan checked the device).
        if self.boxes is None:
            args = [t.data_ptr() for t in tensors]
        elif self.tma_meta is None:
            args = [
                t.data_ptr() if b is None else compat.unchecked_descriptor(t, b)
                for t, b in zip(tensors, self.boxes, strict=True)
            ]
        else:
            args, slot = [], 0
            for t, b in zip(tensors, self.boxes, strict=True):
                if b is None:
                    args.append(t.data_ptr())
                else:
                    args += self.encoded[slot].get(t.data_ptr()) or self._encode(slot, t, b)
                    slot += 1
        gx, gy = self.grid
        self.launch(gx, gy, 1, stream, *self.prefix, *args, *self.tail)
