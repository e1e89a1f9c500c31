"""Attention plans: everything about an attention call that its shapes, strides, dtypes, alignment,
device and causality fix, made once per call signature. The model calls attention 2 x layers times per
step, and at short sequences a call is host-bound, so a known signature's call only allocates its outputs
and hands the tensors to compiled kernels' launchers: no checks, tuning lookups or argument building.

The tuner (or the shipped table) supplies each pass's config; :mod:`select` decides what runs, and the
plan builds its launches from that choice and records it (:func:`launched`), so bench rows name the
kernels that ran.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch

from . import compat
from .configs import KERNELS, TileConfig, candidate_configs, tune_key
from .launch import KernelPlan, Launch, dkdv_launch, dq_launch, fwd_launch, one_pass_launches
from .select import Case, KernelChoice, Layouts, PassChoice, is_hopper, layouts_of, resolve, select
from .settings import INTERPRET
from .tuner import TUNER, Tuner


def as_4d(t: torch.Tensor) -> torch.Tensor:
    """(..., seq, d) -> (batch, heads, seq, d): a view for 2-, 3- and 4-D tensors (strides kept as they
    are); more leading dims are folded into the batch axis."""
    if t.ndim == 4:
        return t
    if t.ndim == 3:
        return t.unsqueeze(1)
    if t.ndim == 2:
        return t[None, None]
    return t.reshape(-1, *t.shape[-3:])


def new_output(q: torch.Tensor) -> torch.Tensor:
    """O for a (batch, heads, n, d) Q, stored as (batch, n, heads, d): the model's
    ``out.transpose(1, 2).reshape(batch, n, heads * d)`` is then a view, not a copy. Other ranks: Q's
    shape, contiguous (one head: the same memory order)."""
    if q.ndim != 4:
        return q.new_empty(q.shape)
    batch, heads, n, d = q.shape
    return q.new_empty((batch, n, heads, d)).transpose(1, 2)


def layout_key(*tensors: torch.Tensor) -> tuple:
    """Strides and 16-byte alignment: what a compiled kernel is specialized on besides shapes and dtypes."""
    return tuple((t.stride(), t.data_ptr() & 15) for t in tensors)


def tune_space(kernel: str, case: tuple) -> tuple[tuple, tuple[TileConfig, ...]]:
    """The tuning key and the candidates of ``kernel`` for ``case`` = (batch * heads, n_q, n_k, d, causal,
    dtype)."""
    return tune_key(kernel, *case), candidate_configs(kernel, case[3], case[5])


def pick(
    kernel: str,
    case: tuple,
    launch: Callable[[TileConfig], None],
    calls: Callable[[TileConfig], list[Launch]] | None = None,
    tuner: Tuner | None = None,
) -> TileConfig:
    """``kernel``'s requested config for ``case`` = (batch * heads, n_q, n_k, d, causal, dtype) (what runs:
    :func:`select.resolve`)."""
    key, candidates = tune_space(kernel, case)
    return (tuner or TUNER).choose(kernel, key, candidates, launch, calls)


# What ran, per case: the latest plan's choice (bench rows read it).
LAUNCHED: dict[Case, KernelChoice] = {}


def record(case: tuple, passes: dict[str, PassChoice], deterministic: bool) -> None:
    """Merge ``passes`` into what ran for ``case`` (a one-pass backward leaves no dQ pass)."""
    old = LAUNCHED.get(Case(*case))
    merged = {**(old.passes() if old else {}), **passes}
    if "dkdv" in passes and passes["dkdv"].config.one_pass:
        merged.pop("dq", None)
    det = deterministic if "dkdv" in passes or old is None else old.deterministic
    LAUNCHED[Case(*case)] = KernelChoice(
        Case(*case), det, merged.get("fwd"), merged.get("dq"), merged.get("dkdv")
    )


def with_fallbacks(choice: PassChoice, plan: KernelPlan | SplitBackward | OnePassBackward) -> PassChoice:
    """``choice`` with the launcher fallbacks of the plan that runs it (what ``launched`` reports)."""
    return replace(choice, fallbacks=plan.fallbacks) if plan.fallbacks else choice


def launched(case: tuple) -> KernelChoice | None:
    return LAUNCHED.get(Case(*case))


def launched_info(case: tuple) -> dict[str, object]:
    """What ran for ``case`` per pass (kernel, config as run, refusals), for a bench row."""
    choice = launched(case)
    return {"launched": choice.describe()} if choice is not None else {}


def chosen_configs(case: tuple) -> dict[str, str]:
    """The config of each pass that ran for ``case`` (as it ran: a refused feature's flag cleared; no dQ
    pass under the one-pass backward); before any ran, the tuner's (forced, chosen or default) ones."""
    choice = launched(case)
    if choice is not None:
        return {name: str(p.config) for name, p in choice.passes().items()}
    out = {}
    for kernel in KERNELS:
        key, candidates = tune_space(kernel, case)
        out[kernel] = str(TUNER.forced.get(kernel) or TUNER.cache.get(key) or candidates[0])
    return out


class SplitBackward:
    """The dQ pass (which also writes D), then the dK/dV pass: two launches and no atomics, so the
    gradients are the same bit for bit on every run."""

    __slots__ = ("dkdv", "dq")

    def __init__(self, dq: KernelPlan, dkdv: KernelPlan):
        self.dq, self.dkdv = dq, dkdv

    @property
    def fallbacks(self) -> tuple[str, ...]:
        """The dK/dV pass's (the dQ pass records its own)."""
        return self.dkdv.fallbacks

    def __call__(self, stream: int, q, k, v, o, do, lse, dq, dk, dv) -> None:
        delta = torch.empty_like(lse)
        self.dq(stream, q, k, v, o, do, lse, delta, dq)
        self.dkdv(stream, q, k, v, do, lse, delta, dk, dv)


class OnePassBackward:
    """D and a zeroed float32 dQ accumulator, then the one-pass kernel (dK, dV, and dQ's shares added by the
    copy engine), then dQ cast from the accumulator. The shares are added in no fixed order, so dQ may
    differ in its last bits from run to run (dK and dV do not); under
    ``torch.use_deterministic_algorithms(True)`` the split backward runs instead."""

    __slots__ = ("delta", "one_pass")

    def __init__(self, delta: KernelPlan, one_pass: KernelPlan):
        self.delta, self.one_pass = delta, one_pass

    @property
    def fallbacks(self) -> tuple[str, ...]:
        return (*self.delta.fallbacks, *self.one_pass.fallbacks)

    def __call__(self, stream: int, q, k, v, o, do, lse, dq, dk, dv) -> None:
        delta = torch.empty_like(lse)
        acc = _dq_accumulator(q)
        self.delta(stream, o, do, delta, acc)
        self.one_pass(stream, q, k, v, do, lse, delta, dk, dv, acc)
        dq.copy_(acc.view(q.shape))


def _dq_accumulator(q: torch.Tensor) -> torch.Tensor:
    """The one-pass backward's float32 dQ, head-major rows [batch * heads * n_q, d] (zeroed by its first
    launch)."""
    batch, heads, n_q, d = q.shape
    return torch.empty((batch * heads * n_q, d), dtype=torch.float32, device=q.device)


class AttentionPlan:
    """The tuned configs and compiled kernels of one call signature: the forward's, and the backward's per
    (O, dO, L) layout and determinism. Tensors have any rank >= 2, (..., seq, d), as (batch, heads, seq, d)
    inside; outputs come back in the inputs' rank. ``tuner``: where configs come from (default the
    process's :data:`TUNER`)."""

    def __init__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        is_causal: bool,
        tuner: Tuner | None = None,
    ):
        q4, k4 = as_4d(q), as_4d(k)
        batch, heads, n_q, d = q4.shape
        self.case = Case(batch * heads, n_q, k4.shape[2], d, is_causal, q.dtype)
        self.is_causal, self.four_d = is_causal, q.ndim == 4
        self.tuner = tuner or TUNER
        self.device = q.get_device()
        if q.is_cuda and self.device != torch.cuda.current_device():
            # Triton compiles and launches on the current device: device pointers of another would fault.
            raise ValueError(
                f"inputs are on {q.device} but the current CUDA device is cuda:{torch.cuda.current_device()}: "
                f"call torch.cuda.set_device({self.device}) (or run inside `with torch.cuda.device({self.device})`)"
            )
        self.hopper = q.is_cuda and not INTERPRET and is_hopper(q.device)
        self.fwd: KernelPlan | None = None
        self.bwd: dict[tuple, SplitBackward | OnePassBackward] = {}
        # (shape, strides) of O and of dQ, dK, dV (empty_like's dense layouts), allocated per call with one
        # empty_strided each. Worked out on meta tensors: no memory.
        qm, km, vm = (
            torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="meta") for x in (q, k, v)
        )
        self.layouts = tuple(
            (x.shape, x.stride()) for x in (new_output(qm), *map(torch.empty_like, (qm, km, vm)))
        )
        self.lse_shape, self.dtype, self.torch_device = q.shape[:-1], q.dtype, q.device

    def _stream(self) -> int:
        return 0 if INTERPRET else compat.current_raw_stream(self.device)

    def _facts(self, **tensors: torch.Tensor) -> Layouts:
        return layouts_of(self.hopper, **tensors)

    def _tuned(
        self, kernel: str, tensors: tuple, calls: Callable[[TileConfig], list[Launch]], build=None
    ) -> tuple[Any, TileConfig]:
        """The plan of ``kernel`` for these tensors and the requested config it was built for: tuned (each
        candidate timed through a plan of its own, ``build(config)``, whose construction launches once, so
        the tuner sees the host cost that calls will pay), compiled and launched once. ``calls(config)``: a
        candidate's launches (built from what :func:`select.resolve` lets run; compiled side by side before
        tuning); ``build`` defaults to the plan of the one launch."""
        build = build or (lambda c: KernelPlan(calls(c)[0]))
        if not INTERPRET and torch.cuda.is_current_stream_capturing():
            # Tuning times and synchronizes, and compiling loads modules: neither can be captured.
            raise RuntimeError(
                f"FlashAttention: the first {kernel!r} call of this signature (shapes {self.case[:4]}, causal="
                f"{self.is_causal}, {self.case[5]}) is being captured in a CUDA graph; it tunes and compiles, "
                "which a graph cannot record. Run one call with the same shapes and layouts before capture "
                "(as torch.compile's CUDA graphs do in their warm-up run)."
            )
        built: dict[TileConfig, Any] = {}

        def launch(c: TileConfig) -> None:
            if c in built:
                built[c](self._stream(), *tensors)
            else:
                built[c] = build(c)

        cfg = pick(kernel, self.case, launch, calls, self.tuner)
        launch(cfg)  # the call's own launch (after tuning, whose launches wrote the same outputs)
        return built[cfg], cfg

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """O (input dtype, layout of :func:`new_output`) and L (float32, contiguous, Q.shape[:-1])."""
        o = self._empty(0)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=self.torch_device)
        tensors = (q, k, v, o, lse) if self.four_d else (*map(as_4d, (q, k, v, o)), lse)
        if self.fwd is None:
            facts = self._facts(**dict(zip(("q", "k", "v", "o", "lse"), tensors, strict=True)))
            run = lambda c: resolve("fwd", c, self.case, facts).config
            self.fwd, cfg = self._tuned(
                "fwd", tensors, lambda c: [fwd_launch(run(c), self.is_causal, *tensors)]
            )
            record(self.case, {"fwd": with_fallbacks(resolve("fwd", cfg, self.case, facts), self.fwd)}, False)
        else:
            self.fwd(self._stream(), *tensors)
        return o, lse

    def backward(
        self, q, k, v, o, do, lse, deterministic: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """dQ, dK, dV (input dtype, the inputs' layouts). ``deterministic`` (default: torch's flag) rules
        out the one-pass backward, whose dQ is added up in no fixed order."""
        if deterministic is None:
            deterministic = torch.are_deterministic_algorithms_enabled()
        if 0 in do.stride() and any(s == 0 and n > 1 for s, n in zip(do.stride(), do.shape, strict=True)):
            # An expanded dO (a sum's gradient, eager and compiled alike): no descriptor reads it, so the
            # Gluon, one-pass and TMA gates would refuse; a copy (~25 µs for the leaderboard's 32 MiB) lets
            # them run.
            do = do.contiguous()
        grads = dq, dk, dv = self._empty(1), self._empty(2), self._empty(3)
        key = (*layout_key(o, do, lse), deterministic)
        if not self.four_d:
            q, k, v, o, do, dq, dk, dv = map(as_4d, (q, k, v, o, do, dq, dk, dv))
        tensors = (q, k, v, o, do, lse, dq, dk, dv)
        run = self.bwd.get(key)
        if run is None:
            if not lse.is_contiguous():
                raise ValueError(
                    f"L must be contiguous, got strides {lse.stride()} for shape {tuple(lse.shape)}"
                )
            self.bwd[key] = self._tuned_backward(tensors, deterministic)
        else:
            run(self._stream(), *tensors)
        return grads

    def _tuned_backward(self, tensors: tuple, deterministic: bool) -> SplitBackward | OnePassBackward:
        """The dQ pass is tuned first (it writes D, which every split dK/dV launch reads), then the dK/dV
        pass, whose candidates are timed as whole backwards: a split one runs after the chosen dQ pass, a
        one-pass one (:func:`one_pass_launches`) alone. Each candidate runs what :func:`select.resolve` lets
        run; the chosen ones are recorded (:func:`launched`)."""
        q, k, v, o, do, lse, dq, dk, dv = tensors
        facts = self._facts(
            **dict(zip(("q", "k", "v", "o", "do", "lse", "dq", "dk", "dv"), tensors, strict=True))
        )
        run = lambda kernel, c: resolve(kernel, c, self.case, facts, deterministic)
        causal = self.is_causal
        delta = torch.empty_like(lse)
        dq_tensors = (q, k, v, o, do, lse, delta, dq)
        dq_plan, dq_cfg = self._tuned(
            "dq", dq_tensors, lambda c: [dq_launch(run("dq", c).config, causal, *dq_tensors)]
        )
        dkdv_tensors = (q, k, v, do, lse, delta, dk, dv)
        acc: list[torch.Tensor] = []  # the accumulator, allocated if a one-pass candidate runs

        def calls(c: TileConfig) -> list[Launch]:
            c = run("dkdv", c).config
            if c.one_pass:
                if not acc:
                    acc.append(_dq_accumulator(q))
                return one_pass_launches(c, causal, q, k, v, o, do, lse, delta, dk, dv, acc[0])
            return [dkdv_launch(c, causal, *dkdv_tensors)]

        def build(c: TileConfig) -> SplitBackward | OnePassBackward:
            """The plan of candidate ``c``, whose construction computes the gradients once."""
            plans = [KernelPlan(call) for call in calls(c)]
            if len(plans) == 1:
                return SplitBackward(dq_plan, plans[0])
            dq.copy_(acc[0].view(q.shape))
            return OnePassBackward(*plans)

        plan, dkdv_cfg = self._tuned("dkdv", tensors, calls, build)
        chosen = select(self.case, facts, {"dq": dq_cfg, "dkdv": dkdv_cfg}, deterministic).passes()
        ran = {"dq": dq_plan, "dkdv": plan}  # every launch of a pass records its fallbacks with it
        record(self.case, {name: with_fallbacks(p, ran[name]) for name, p in chosen.items()}, deterministic)
        return plan

    def _empty(self, which: int) -> torch.Tensor:
        shape, stride = self.layouts[which]
        return torch.empty_strided(shape, stride, dtype=self.dtype, device=self.torch_device)


# Plans by call signature: a few per model; cleared with the tuning cache and when a config is forced.
PLANS: dict[tuple, AttentionPlan] = {}


def attention_plan(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    is_causal: bool,
    *,
    check: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], None] | None = None,
) -> AttentionPlan:
    """The plan for this call's signature; ``check`` validates the inputs when a new plan is made (a known
    signature was valid when first seen, and its key holds everything the checks look at)."""
    try:
        key = (
            q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.get_device(), k.get_device(), v.get_device(),
            is_causal, *layout_key(q, k, v),
        )  # fmt: skip
    except (AttributeError, TypeError, RuntimeError):
        if check is not None:
            check(q, k, v, is_causal)  # names what is wrong with the inputs
        raise
    plan = PLANS.get(key)
    if plan is None:
        if check is not None:
            check(q, k, v, is_causal)
        plan = PLANS[key] = AttentionPlan(q, k, v, is_causal)
    return plan


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool):
    """O (input dtype, layout of :func:`new_output`) and L (float32, contiguous (batch, heads, n_q)) for 4-D
    (batch, heads, seq, d) inputs of any strides."""
    return attention_plan(q, k, v, is_causal).forward(q, k, v)


def flash_backward(q, k, v, o, do, lse, is_causal: bool, deterministic: bool | None = None):
    """dQ, dK, dV (input dtype) for 4-D inputs of any strides, L contiguous (batch, heads, n_q);
    ``deterministic`` defaults to torch's flag."""
    return attention_plan(q, k, v, is_causal).backward(q, k, v, o, do, lse, deterministic)
