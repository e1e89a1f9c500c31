"""Which kernel runs: one pure function, :func:`select`, in the manner of FlashAttention's ``hopper/``
``tile_size.h`` / ``heuristics.h``. The table and the tuner supply configs only (what was *asked* for a
pass); every gate that decides what *runs* lives here: Gluon (Hopper, dtype, head dim, tile multiples,
layouts), tensor descriptors, the one-pass backward and determinism. A gate that refuses leaves a recorded
reason in the :class:`PassChoice`, never a silent fallback, and the launches are built from the choice, so
what a row records is what ran.

Also here: :func:`route_for`, the routing rule that docs/architecture.md tables (a test holds the two
together).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal, NamedTuple

import torch

from .configs import TileConfig

Pass = Literal["fwd", "dq", "dkdv"]
Route = Literal["plan", "op"]
GLUON_HEAD_DIMS = (64, 128)
_PREFIX = {"fwd": "flash_fwd", "dq": "flash_bwd_dq", "dkdv": "flash_bwd_dkdv"}


def kernel_name(pass_: Pass, c: TileConfig) -> str:
    """The entry kernel that ``c`` (as resolved) launches for ``pass_``."""
    if c.one_pass:
        return "flash_bwd_one_pass_ws_kernel"  # (after flash_bwd_delta_kernel)
    return f"{_PREFIX[pass_]}{'_ws' if c.ws else '_gluon' if c.gluon else ''}_kernel"


class Case(NamedTuple):
    """What a tuning key is made of: (batch * heads, n_q, n_k, d, causal, dtype)."""

    bh: int
    n_q: int
    n_k: int
    d: int
    causal: bool
    dtype: torch.dtype


@dataclass(frozen=True)
class Facts:
    """What the gates read of one (batch, heads, seq, d) tensor."""

    dtype: torch.dtype
    seq_major: bool | None  # seq_major(): how a 2-D descriptor reads it, None: not at all
    dense: bool  # head- or seq-major rows without padding
    contiguous: bool
    tma: bool  # a Triton tensor descriptor can take it
    d_contiguous: bool


@dataclass(frozen=True)
class Layouts:
    """The call's device and tensors (by name: q, k, v, o, do, lse, dq, dk, dv; absent: not known yet)."""

    hopper: bool  # an sm_90 GPU (wgmma and the copy engine's descriptors)
    tensors: Mapping[str, Facts]


@dataclass(frozen=True)
class PassChoice:
    pass_: Pass
    requested: TileConfig  # the table's or the tuner's
    config: TileConfig  # what runs: a refused feature's flag cleared
    kernel: str
    refused: tuple[str, ...] = ()  # why a requested feature does not run
    # Set by the plan that launched it (never by select): why its launches went through Triton's own
    # launcher or JIT instead of the launcher's C entry point (KernelPlan.fallbacks).
    fallbacks: tuple[str, ...] = ()

    def describe(self) -> dict[str, object]:
        out: dict[str, object] = {"kernel": self.kernel, "config": str(self.config)}
        if self.refused:
            out.update(requested=str(self.requested), refused=list(self.refused))
        if self.fallbacks:
            out["fallbacks"] = list(self.fallbacks)
        return out


@dataclass(frozen=True)
class KernelChoice:
    """What runs for a call: per pass, and which backward (no dQ pass where the one-pass kernel runs)."""

    case: Case
    deterministic: bool
    fwd: PassChoice | None  # None: not chosen (yet)
    dq: PassChoice | None  # None: not chosen, or the one-pass backward runs no dQ pass
    dkdv: PassChoice | None

    @property
    def backward(self) -> str:
        if self.dkdv is None:
            return "not chosen"
        return "one-pass" if self.dkdv.config.one_pass else "split"

    def passes(self) -> dict[str, PassChoice]:
        return {p.pass_: p for p in (self.fwd, self.dq, self.dkdv) if p is not None}

    def describe(self) -> dict[str, object]:
        passes = {name: p.describe() for name, p in self.passes().items()}
        return {"backward": self.backward, **passes}


# --------------------------------------------------------------------------------------------------------
# Facts from tensors
# --------------------------------------------------------------------------------------------------------


def seq_major(t: torch.Tensor, aligned: bool | None = None) -> bool | None:
    """How a Gluon kernel reads the (batch, heads, seq, d) tensor ``t`` through a 2-D descriptor of
    [tile, d] boxes: False, head-major rows [batch * heads * seq, d] (contiguous, or rows padded); True,
    seq-major rows [batch * seq, heads * d] with each head's d columns side by side (the model's V, a view
    of the fused QKV projection, and dO in O's layout); None, neither, or not aligned for the copy engine.
    ``aligned``: whether the base is 16-byte aligned (default: read from ``t``; meta tensors have none)."""
    b, h, n, d = t.shape
    sb, sh, sn, sd = t.stride()
    aligned = (t.data_ptr() % 16 == 0) if aligned is None else aligned
    if sd != 1 or not aligned or (sn * t.element_size()) % 16 or sn < d:
        return None
    if (h == 1 or sh == n * sn) and (b == 1 or sb == h * n * sn):
        return False
    if (h == 1 or sh == d) and (b == 1 or sb == n * sn) and sn >= h * d:
        return True
    return None


def facts(t: torch.Tensor, aligned: bool | None = None) -> Facts:
    """``t``'s :class:`Facts` (a 4-D tensor; lse is 3-D and only its dtype and contiguity count)."""
    aligned = (t.data_ptr() % 16 == 0) if aligned is None else aligned
    contiguous, size = t.is_contiguous(), t.element_size()
    if t.ndim != 4:
        return Facts(t.dtype, None, contiguous, contiguous, False, t.stride(-1) == 1)
    major = seq_major(t, aligned)
    dense = major is not None and t.stride(2) == (t.shape[1] * t.shape[3] if major else t.shape[3])
    tma = aligned and t.stride(3) == 1 and not any((t.stride(i) * size) % 16 for i in range(3))
    return Facts(t.dtype, major, dense, contiguous, tma, t.stride(-1) == 1)


def layouts_of(hopper: bool, aligned: bool | None = None, **tensors: torch.Tensor) -> Layouts:
    return Layouts(hopper, {name: facts(t, aligned) for name, t in tensors.items()})


def is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


# --------------------------------------------------------------------------------------------------------
# The gates
# --------------------------------------------------------------------------------------------------------

# Per pass: the inputs read by descriptor (Q, K, V, dO), the outputs written by pointer, and those read
# or written through Triton's descriptors.
_INPUTS = {"fwd": ("q", "k", "v"), "dq": ("q", "k", "v", "do"), "dkdv": ("q", "k", "v", "do")}
_OUTPUTS = {"fwd": (), "dq": ("dq",), "dkdv": ("dk", "dv")}
_TMA = {
    "fwd": ("q", "k", "v", "o"),
    "dq": ("q", "k", "v", "do", "dq"),
    "dkdv": ("q", "k", "v", "do", "dk", "dv"),
}


def gluon_refusal(pass_: Pass, c: TileConfig, case: Case, layouts: Layouts) -> str | None:
    """Why a Gluon kernel cannot run ``pass_`` with ``c``'s tiles here, or None. It needs a Hopper GPU,
    2-byte floats, d of 64 or 128, tensors of Q's dtype whose lengths are multiples of the tiles (a
    descriptor's rows then never cross a head), L contiguous float32, O with a contiguous d axis, and for
    dK/dV diagonal tiles that line up with the query steps. Inputs are contiguous, except that the dK/dV and
    warp-specialized passes take either layout of :func:`seq_major` (with dense outputs)."""
    t = layouts.tensors
    names = (*_INPUTS[pass_], *_OUTPUTS[pass_])
    if not layouts.hopper:
        return "not a Hopper (sm_90) GPU"
    if case.dtype not in (torch.bfloat16, torch.float16) or any(t[n].dtype != case.dtype for n in names):
        return f"{case.dtype} (Gluon kernels take bf16/fp16 of one dtype)"
    if case.d not in GLUON_HEAD_DIMS:
        return f"head dim {case.d} (Gluon kernels take {GLUON_HEAD_DIMS})"
    if case.n_q % c.q_tile or case.n_k % c.k_tile:
        return f"lengths ({case.n_q}, {case.n_k}) not multiples of the tiles ({c.q_tile}, {c.k_tile})"
    if pass_ == "dkdv" and c.k_tile % c.q_tile:
        return "dK/dV key tile not a multiple of the query tile"
    if pass_ == "dkdv" or c.ws:
        if any(t[n].seq_major is None for n in _INPUTS[pass_]) or not all(
            t[n].dense for n in _OUTPUTS[pass_]
        ):
            return "a layout no 2-D descriptor reads (or a padded output)"
    elif not all(t[n].contiguous for n in names):
        return "non-contiguous tensors (the non-specialized pass reads contiguous ones)"
    if t["lse"].dtype != torch.float32 or not t["lse"].contiguous:
        return "L not contiguous float32"
    if pass_ != "dkdv" and (t["o"].dtype != case.dtype or not t["o"].d_contiguous):
        return "O not of Q's dtype with a contiguous d axis"
    return None


def one_pass_refusal(c: TileConfig, layouts: Layouts, deterministic: bool) -> str | None:
    """Why the one-pass backward cannot run (its Gluon gates apart), or None."""
    if deterministic:
        return "deterministic algorithms: dQ's shares are added in no fixed order (the split twin runs)"
    if c.q_tile != 64:
        return "the one-pass kernel takes 64-query tiles (the M of its dQ = dS K matmul)"
    if not layouts.tensors["o"].d_contiguous:
        return "O's d axis not contiguous (the delta kernel reads it by rows)"
    return None


def resolve(
    pass_: Pass, c: TileConfig, case: Case, layouts: Layouts, deterministic: bool = False
) -> PassChoice:
    """What runs for ``pass_`` given the requested config ``c``: each feature kept or refused with why."""
    refused: list[str] = []
    run = c
    if run.one_pass:
        why = one_pass_refusal(run, layouts, deterministic)
        if why is not None:
            refused.append(f"one-pass: {why}")
            run = replace(run, one_pass=False)
    if run.gluon:
        why = gluon_refusal(pass_, run, case, layouts)
        if why is not None:
            refused.append(f"gluon: {why}")
            run = replace(run, gluon=False, ws=False, one_pass=False)
    if run.tma and not run.gluon and not all(layouts.tensors[n].tma for n in _TMA[pass_]):
        refused.append("tma: strides or base not 16-byte aligned for a descriptor")
        run = replace(run, tma=False)
    return PassChoice(pass_, c, run, kernel_name(pass_, run), tuple(refused))


def select(
    case: Case,
    layouts: Layouts,
    configs: Mapping[str, TileConfig],
    deterministic: bool | None = None,
) -> KernelChoice:
    """The kernels of a call: ``configs`` (per pass, from the table or the tuner; the passes not given stay
    unchosen) through every gate; no dQ pass where the one-pass backward runs. ``deterministic`` defaults
    to ``torch.are_deterministic_algorithms_enabled()``."""
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    chosen = {name: resolve(name, cfg, case, layouts, deterministic) for name, cfg in configs.items()}
    if "dkdv" in chosen and chosen["dkdv"].config.one_pass:
        chosen.pop("dq", None)
    return KernelChoice(case, deterministic, chosen.get("fwd"), chosen.get("dq"), chosen.get("dkdv"))


def route_for(*, compiling: bool, dispatch_mode: bool) -> Route:
    """The route of a call (docs/architecture.md's route table): an eager call takes its plan; a compiled
    one, or one under a Python dispatch mode, the opaque op (whose body runs the same plan)."""
    return "op" if compiling or dispatch_mode else "plan"
