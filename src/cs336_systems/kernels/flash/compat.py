"""Every private Triton and torch hook of the FlashAttention stack, for the versions it targets.

Targets: triton 3.6 (``TRITON_TARGET``; pinned in pyproject.toml) and torch 2.11 (the GPU machines) to
2.13 (CPU CI) (``TORCH_TARGETS``). Each hook below reads an internal that another version may rename or
change in meaning; read wrongly, a launcher takes shifted arguments and faults. So
:func:`check_versions` (run when this module, the first that ``kernels.flash`` imports, is imported)
refuses other versions in one line, at import, instead of letting a hook misbehave.

The hooks, and why each exists:
- :func:`kernel_launcher`, :func:`encode_descriptor`, :func:`unchecked_descriptor`: a plan calls the
  compiled kernel's C launcher directly, with tensor maps encoded once per address (eager calls at short
  sequences are host-bound, so the host's time per call is the figure; measured: docs/perf-notes.md,
  FlashAttention-2, "Per-signature plans and host-aware tuning"); where it cannot,
  it launches through Triton's own launcher and :func:`kernel_launcher` says why (the plan records it).
  Only this module reads a compiled kernel's attributes (``run``, ``function``, ``packed_metadata``,
  ``metadata``): a test scans the other modules of ``kernels/flash`` for them;
- :func:`reduce_add_async`: Gluon 3.6 has the copy engine's reduction only on its op builder (the
  one-pass backward adds dQ's shares with it);
- :func:`current_raw_stream`, :func:`dispatch_mode_active`: torch internals that the plans and the routing
  read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import triton

TRITON_TARGET = "3.6"
TORCH_TARGETS = ("2.11", "2.12", "2.13")


def _minor(version: str) -> str:
    return ".".join(version.split("+")[0].split(".")[:2])


def check_versions(triton_version: str = triton.__version__, torch_version: str = torch.__version__) -> None:
    """Raise one line naming the versions when they are not the targeted ones."""
    if _minor(triton_version) != TRITON_TARGET or _minor(torch_version) not in TORCH_TARGETS:
        raise RuntimeError(
            f"cs336_systems.kernels.flash targets triton {TRITON_TARGET} and torch {'/'.join(TORCH_TARGETS)} "
            f"(private hooks in kernels/flash/compat.py); found triton {triton_version}, torch {torch_version}: "
            "install the versions pinned in pyproject.toml"
        )


# Before the private imports below, which another version may not have.
check_versions()

from torch.utils._python_dispatch import _get_current_dispatch_mode  # noqa: E402
from triton._C.libtriton import ir  # noqa: E402
from triton.experimental.gluon.language._core import builtin  # noqa: E402
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402


class KernelLauncher(NamedTuple):
    """How a plan launches one compiled kernel: ``launch(grid_x, grid_y, 1, stream, *prefix, *arguments)``,
    the arguments being device addresses, descriptors (objects, or the tensor maps of
    :func:`encode_descriptor` where ``tma_meta`` is set) and the scalars."""

    launch: Callable[..., None]
    prefix: tuple  # the kernel's handle and the launcher's options, before the kernel's own arguments
    tma_meta: tuple | None  # per descriptor argument, what encode_descriptor takes; None: objects
    fallback: str | None  # why the launch goes through Triton's own launcher, or None (the C entry point)


SCRATCH_FALLBACK = (
    "Triton's launcher: the kernel needs scratch memory, which its Python wrapper allocates per launch"
)
UNWRAPPED_FALLBACK = (
    "Triton's descriptor wrapper: no launcher found under it, so tensor maps are encoded on every launch"
)
NO_TMA_FALLBACK = "Triton's descriptor wrapper: descriptors lowered without TMA, unpacked on every launch"


def kernel_launcher(compiled: Any, descriptors: bool) -> KernelLauncher:
    """How to launch ``compiled`` (Triton 3.6's ``CompiledKernel``) with the least host work: the C entry
    point of its launcher (``run.launch``, under the Python wrapper that builds scratch-allocation closures
    on every call); for a kernel with ``descriptors``, the launcher under Triton's wrapper that encodes each
    descriptor into a tensor map per launch (:func:`raw_launcher`), given maps the plan keeps per address.
    Where one of these cannot be had, Triton's own launcher or wrapper, and the ``fallback`` reason."""
    run = compiled.run  # (loads the binary: the kernel's handle is set from here on)
    function = compiled.function
    if getattr(run, "global_scratch_size", 1) or getattr(run, "profile_scratch_size", 1):
        return KernelLauncher(
            run, (function, compiled.packed_metadata, None, None, None), None, SCRATCH_FALLBACK
        )
    prefix = (
        function,
        run.launch_cooperative_grid,
        run.launch_pdl,
        None,
        None,
        compiled.packed_metadata,
        None,
        None,
        None,
    )
    if not descriptors:
        return KernelLauncher(run.launch, prefix, None, None)
    raw = raw_launcher(run.launch)
    if raw is None:
        return KernelLauncher(run.launch, prefix, None, UNWRAPPED_FALLBACK)
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    if not metas or any(m is None for m in metas):
        return KernelLauncher(run.launch, prefix, None, NO_TMA_FALLBACK)
    return KernelLauncher(raw, prefix, tuple(metas), None)


def raw_launcher(launch: Callable[..., None]) -> Callable[..., None] | None:
    """The launcher under Triton's wrapper that encodes tensor descriptors on every call (the wrapper's
    closure cell ``launcher``), or None."""
    closure = getattr(launch, "__closure__", None) or ()
    names = getattr(getattr(launch, "__code__", None), "co_freevars", ())
    cell = dict(zip(names, closure, strict=False)).get("launcher")
    return None if cell is None else cell.cell_contents


def encode_descriptor(desc: TensorDescriptor, meta: Any) -> list:
    """The launcher's arguments for ``desc``: its CUDA tensor map, shape and strides."""
    from triton.backends.nvidia.driver import make_tensordesc_arg

    return make_tensordesc_arg(desc, meta)


def unchecked_descriptor(base: torch.Tensor, box: tuple) -> TensorDescriptor:
    """A descriptor of ``box`` = (shape, strides, block shape) over ``base`` without its constructor's
    checks, for a layout a plan checked once (the checks cost more host time than the launch)."""
    desc = object.__new__(TensorDescriptor)
    desc.base, desc.padding = base, "zero"
    desc.shape, desc.strides, desc.block_shape = box
    return desc


@builtin
def reduce_add_async(tensor_desc, coord, src, _semantic=None):
    """Add a shared-memory tile into global memory at ``coord`` by the copy engine
    (cp.reduce.async.bulk.tensor); wait with ``tma.store_wait`` before overwriting ``src``. Gluon 3.6 has
    the op only on its builder (Triton's ``desc.atomic_add`` lowers to it)."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(
        ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle
    )


def current_raw_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def dispatch_mode_active() -> bool:
    """Whether a Python dispatch mode (selective checkpointing, FlopCounterMode) is active (every eager
    call asks: the lookup is imported once, not per call)."""
    return _get_current_dispatch_mode() is not None
