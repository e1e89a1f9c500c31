"""Every grading case in one declarative table, read by the judging process and by the workers alike.

A case names its hooks, tier, device, dtype, shape or model, world size and tolerance; nothing about a
case depends on the machine except whether it can run there (``Case.runs_here``). Tiers:

- ``course``: what the course's own tests run: their shapes, dtypes, models, steps, optimizers and
  tolerances, and their device placement (the PyTorch attention on the CPU, Triton on a GPU, the
  data-parallel families on ``cuda:{rank % device_count}`` whenever CUDA is available, gloo always).
- ``leaderboard``: the 2025 leaderboard's case (Triton, bf16, causal, under ``torch.compile(apply)``).
- ``beyond``: what the handout promises not to test (lengths below a plausible tile or no tile divides,
  n_queries != n_keys, bf16, bad input) and what a careful implementation still gets right (frozen,
  unused and tied parameters, 3-4 ranks, sizes no world size divides, per-group optimizer options).

Device values: ``cpu``; ``cuda`` (skipped with kind ``needs-gpu`` where there is none, unless
``interpreter_stand_in``: then it runs on the CPU under Triton's interpreter, the same function at the
same tolerance); ``course`` (the course's placement above). What each tier means is one
``TierRules`` record in ``TIERS``: the case builders read it, and so do the report, the exit status and
the leaderboard's gate, instead of comparing tier names. This module imports nothing but the standard
library: it is the one table both sides of the process boundary read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

COURSE, LEADERBOARD, BEYOND = "course", "leaderboard", "beyond"
COURSE_PLACEMENT = "course"  # a device value: the course's placement (above), not the tier

# Structured skip kinds (never searched for in message text).
NOT_IMPLEMENTED, NEEDS_GPU, REFUSES_CPU = "not-implemented", "needs-gpu", "refuses-cpu"
UNFINISHED_HERE = "could-not-grade-here"  # the machine could not finish it (overloaded, a lost connection)

ATTENTION_HOOKS = {
    "pytorch": "get_flashattention_autograd_function_pytorch",
    "triton": "get_flashattention_autograd_function_triton",
}
DDP_HOOKS = {
    "individual": ("get_ddp_individual_parameters", "ddp_individual_parameters_on_after_backward"),
    "bucketed": ("get_ddp_bucketed", "ddp_bucketed_on_after_backward", "ddp_bucketed_on_train_batch_start"),
    "ddp2026": ("get_ddp", "ddp_on_after_backward"),
}
SHARDED_HOOKS = ("get_sharded_optimizer",)
FSDP_HOOKS = ("get_fsdp", "fsdp_on_after_backward", "fsdp_gather_full_params")


@dataclass(frozen=True)
class LeaderboardCase:
    """The 2025 leaderboard's case, declared once: q, k, v of ``shape`` (batch 1 x 16 heads as the
    course's (16, 16384, 64) tensors), causal, bf16, timed by ``do_bench(rep, warmup)``'s mean."""

    shape: tuple[int, int, int] = (16, 16384, 64)
    causal: bool = True
    dtype: str = "bf16"
    rep_ms: int = 10000
    warmup_ms: int = 1000

    @property
    def attention_shape(self) -> tuple[int, int, int, int]:
        """(batch, n_queries, n_keys, d), as the case table's attention cases read."""
        b, s, d = self.shape
        return (b, s, s, d)


LEADERBOARD_CASE = LeaderboardCase()
LEADERBOARD_SHAPE = LEADERBOARD_CASE.attention_shape
TRITON_HOOK = ATTENTION_HOOKS["triton"]


@dataclass(frozen=True)
class Tolerance:
    """``|got - ref| <= atol + rtol * |ref|`` elementwise (``torch.testing.assert_close``'s form), or, with
    ``plain_factor``, ``max|got - ref64| <= max(plain_factor x the error of plain PyTorch attention in the
    same dtype, floor x max|ref64|)`` (FlashAttention's own tests' form; ``ref64`` is float64)."""

    atol: float = 0.0
    rtol: float = 0.0
    plain_factor: float | None = None
    floor: float = 0.0
    source: str = ""  # where the bound comes from, for messages

    def describe(self) -> str:
        if self.plain_factor is not None:
            return f"max({self.plain_factor:g} x plain PyTorch's error, {self.floor:g} x max|ref|)"
        text = f"atol {self.atol:g} + rtol {self.rtol:g}·|ref|" if self.atol or self.rtol else "exact"
        return f"{text} ({self.source})" if self.source else text


@dataclass(frozen=True)
class Case:
    id: str
    family: str  # attention | ddp | sharded | fsdp
    hooks: tuple[str, ...]
    tier: str
    device: str  # cpu | cuda | course
    dtype: str
    tolerance: Tolerance
    world_size: int = 1
    shape: tuple[int, ...] = ()
    model: str = ""
    knobs: dict[str, Any] = field(default_factory=dict, hash=False, compare=False)
    why: str = ""  # why a case sits in its tier, when the tier alone does not say

    def knob(self, name: str, default: Any = None) -> Any:
        return self.knobs.get(name, default)

    def runs_here(self, has_gpu: bool) -> bool:
        return self.device != "cuda" or has_gpu or bool(self.knob("interpreter_stand_in"))


# -- tiers --------------------------------------------------------------------------------------------

COURSE_ATTENTION_TOL = Tolerance(1e-2, 1e-2, source="the course's assert_close(rtol=1e-2, atol=1e-2)")


@dataclass(frozen=True)
class TierRules:
    """What a tier means, declared once. The case builders below read it, so that a tier's device,
    dtype or batch is not decided again in each builder; the report, the exit status and the
    leaderboard's gate read ``graded`` and ``gates_rank`` instead of comparing tier names."""

    # Attention: the bound every case of the tier is held to; None: relative to plain PyTorch in the
    # case's dtype (``PLAIN_FACTOR``, ``BEYOND_FLOOR``).
    attention_tolerance: Tolerance | None
    # Whether its small Triton cases run under Triton's interpreter where there is no GPU (never the
    # leaderboard's: a GPU's case, skipped without one).
    stand_in: bool
    # The data-parallel families (DDP, sharded optimizer, FSDP): where their inputs and ranks sit, and the
    # dtype the DDP and sharded models train in (their reference trains in it too).
    trained_device: str
    trained_dtype: str
    fsdp_batch: int  # FSDP's global batch, split over the ranks
    state_checked: bool  # FSDP: each rank's state checked after every step, not only what it gathers
    graded: bool  # a failure fails the hook group (FAIL) and the run's exit status
    gates_rank: bool  # the Triton hook's cases here must pass before a leaderboard row is ranked


# A careful implementation: float64 toy models on the CPU, where any mismatch is a bug.
CAREFUL = TierRules(
    attention_tolerance=None,
    stand_in=True,
    trained_device="cpu",
    trained_dtype="fp64",
    fsdp_batch=6,
    state_checked=True,
    graded=False,
    gates_rank=False,
)
TIERS: dict[str, TierRules] = {
    # The course's own tests: their tolerances, their placement and dtype, a batch of 20; neither sharded
    # storage nor fp32 masters nor the compute dtype in training checked.
    COURSE: TierRules(
        attention_tolerance=COURSE_ATTENTION_TOL,
        stand_in=True,
        trained_device=COURSE_PLACEMENT,
        trained_dtype="fp32",
        fsdp_batch=20,
        state_checked=False,
        graded=True,
        gates_rank=True,
    ),
    # The 2025 leaderboard's case: attention only (its data-parallel rules are beyond's, never read).
    LEADERBOARD: replace(CAREFUL, stand_in=False),
    BEYOND: CAREFUL,
}
GRADED_TIERS = tuple(t for t, rules in TIERS.items() if rules.graded)
RANK_GATES = tuple(t for t, rules in TIERS.items() if rules.gates_rank)


# -- attention ----------------------------------------------------------------------------------------

# Beyond: relative to plain PyTorch in the same dtype. The floor of fp32 on a GPU allows for tl.dot's
# default TF32 (10 mantissa bits, about 2e-3 of the largest value at these sizes); a Triton case keeps
# the GPU's floor when its stand-in runs under the interpreter, so one id means one tolerance.
BEYOND_FLOOR = {("fp32", "cpu"): 1e-4, ("fp32", "cuda"): 8e-3, ("bf16", "cpu"): 1e-2, ("bf16", "cuda"): 1e-2}
PLAIN_FACTOR = 10.0
COURSE_ATTENTION_SHAPE = (4, 128, 128, 64)  # the course's _make_attn_inputs
BAD_SHAPES = {
    "bad-head-dims": (2, 33, 33, 16),
    "bad-kv-lengths": (2, 33, 40, 16),
    "bad-batch-sizes": (3, 33, 33, 16),
}


def _attention(
    kind: str,
    tier: str,
    shape: tuple,
    causal: bool,
    dtype: str,
    device: str,
    check: str = "match",
    why: str = "",
) -> Case:
    b, nq, nk, d = shape
    name = f"{tier}-{kind}-{check}-b{b}-q{nq}-k{nk}-d{d}-{'causal' if causal else 'full'}-{dtype}-{device}"
    rules = TIERS[tier]
    tol = rules.attention_tolerance
    if tol is None:
        tol = Tolerance(plain_factor=PLAIN_FACTOR, floor=BEYOND_FLOOR[(dtype, device)])
    # A Triton case small enough for the interpreter runs there where no GPU is (the course skips).
    stand_in = kind == "triton" and rules.stand_in and max(nq, nk) <= 128
    return Case(
        id=name,
        family="attention",
        hooks=(ATTENTION_HOOKS[kind],),
        tier=tier,
        device=device,
        dtype=dtype,
        tolerance=tol,
        shape=tuple(shape),
        knobs={"kind": kind, "causal": causal, "check": check, "interpreter_stand_in": stand_in},
        why=why,
    )


SMALL_WHY = (
    "a length below a plausible tile (the handout: powers of 2 of at least 16, no out-of-bounds worries)"
)
ODD_WHY = "a length no tile divides (the handout promises powers of 2)"
BIG_SHAPES = ((2, 1000, 1537, 64), (1, 3001, 2049, 128), (4, 4097, 4097, 64))


def _attention_cases() -> list[Case]:
    cases = [_attention("pytorch", COURSE, COURSE_ATTENTION_SHAPE, False, "fp32", "cpu")]
    cases += [_attention("triton", COURSE, COURSE_ATTENTION_SHAPE, c, "fp32", "cuda") for c in (False, True)]
    unmasked = "the course tests the PyTorch hook without a mask"
    cases.append(_attention("pytorch", BEYOND, COURSE_ATTENTION_SHAPE, True, "fp32", "cpu", why=unmasked))
    for kind, device in (("pytorch", "cpu"), ("triton", "cuda")):
        for shape in ((2, 16, 16, 16), (2, 64, 64, 16)):
            cases += [
                _attention(kind, BEYOND, shape, c, "fp32", device, why=SMALL_WHY) for c in (False, True)
            ]
        for shape in ((2, 37, 37, 16), (2, 45, 83, 16), (2, 83, 45, 16)):
            cases += [
                _attention(kind, BEYOND, shape, c, dt, device, why=ODD_WHY)
                for c in (False, True)
                for dt in ("fp32", "bf16")
            ]
        cases += [
            _attention(kind, BEYOND, s, False, "fp32", device, check=bad) for bad, s in BAD_SHAPES.items()
        ]
        cases += [
            _attention(kind, BEYOND, shape, c, dt, "cuda", why=ODD_WHY)
            for shape in BIG_SHAPES
            for c in (False, True)
            for dt in ("fp32", "bf16")
        ]
    lb = LEADERBOARD_CASE  # a length short enough to match, then the leaderboard's own under compile
    cases.append(_attention("triton", LEADERBOARD, (16, 2048, 2048, 64), lb.causal, lb.dtype, "cuda"))
    cases.append(
        _attention("triton", LEADERBOARD, LEADERBOARD_SHAPE, lb.causal, lb.dtype, "cuda", check="compile")
    )
    return cases


# -- data-parallel families ---------------------------------------------------------------------------

ALLCLOSE = Tolerance(1e-8, 1e-5, source="the course's torch.allclose defaults")
FLOAT64 = Tolerance(1e-10, 0.0, source="float64: any mismatch is a bug, not rounding")
# What the data-parallel judges check is declared per case: the course's tests check less than a careful
# implementation gets right, and the judges read these knobs, never the tier.
# DDP: after wrapping every rank holds rank 0's weights within ``wrap_tolerance``; ``every_rank``
# compares each rank's parameters with the reference every step (else rank 0's only, as the course);
# ``every_step_gradients`` checks the gradients after the hook every step (else only to explain a
# parameter miss); ``ranks_agree``: all ranks end with identical weights.
COURSE_DDP_CHECKS = {
    "wrap_tolerance": ALLCLOSE,
    "every_rank": False,
    "every_step_gradients": False,
    "ranks_agree": False,
}
BEYOND_DDP_CHECKS = {
    "wrap_tolerance": Tolerance(),
    "every_rank": True,
    "every_step_gradients": True,
    "ranks_agree": True,
}
DDP_CHECKS = tuple(COURSE_DDP_CHECKS)
# The course's data-parallel run: a global batch of 20 (10 features in, 5 out), MSE, SGD(lr=0.1),
# 5 steps, reshuffled each step; ranks start from different weights (seeded by rank).
COURSE_DDP = {
    "steps": 5,
    "global_batch": 20,
    "optimizer": "sgd",
    "shuffle": True,
    "extra": "all",
    **COURSE_DDP_CHECKS,
}


def _ddp(family: str, tier: str, ws: int, model: str, tol: Tolerance, **knobs: Any) -> Case:
    bucket = knobs.get("bucket_mb")
    parts = [family, tier, f"ws{ws}", model, knobs.get("extra", "all")]
    parts += [f"{bucket}MB"] if bucket is not None else []
    parts.append(knobs["optimizer"])
    return _trained(
        "-".join(parts), "ddp", DDP_HOOKS[family], tier, ws, model, tol, {"family": family, **knobs}
    )


def _trained(
    cid: str, family: str, hooks: tuple[str, ...], tier: str, ws: int, model: str, tol: Tolerance, knobs: dict
) -> Case:
    """A data-parallel case, placed and typed by its tier's rules: the course's models in fp32 where the
    course places them; beyond, float64 toy models on the CPU, where any mismatch is a bug."""
    rules = TIERS[tier]
    return Case(
        id=cid,
        family=family,
        hooks=hooks,
        tier=tier,
        device=rules.trained_device,
        dtype=rules.trained_dtype,
        tolerance=tol,
        world_size=ws,
        model=model,
        knobs=knobs,
    )


def _ddp_cases() -> list[Case]:
    cases = [
        _ddp(family, COURSE, 2, model, ALLCLOSE, **COURSE_DDP)
        for family in ("individual", "ddp2026")
        for model in ("course-toy", "course-tied")
    ]
    # 1.0.5's bucket sizes: two buckets, three (one parameter each), one; compared with atol=1e-4.
    bucket_tol = Tolerance(1e-4, 1e-5, source="the course's torch.allclose(atol=1e-4)")
    cases += [
        _ddp("bucketed", COURSE, 2, model, bucket_tol, bucket_mb=mb, **COURSE_DDP)
        for model in ("course-toy", "course-tied")
        for mb in (0.0016, 0.0001, 0.01)
    ]
    # Only bucketed DDP must cope with a parameter some ranks use and others do not (rank0): the
    # per-parameter variants communicate from gradient hooks, like torch DDP without
    # find_unused_parameters, so a parameter gets a gradient on all ranks or on none.
    beyond = {
        "individual": (
            (3,),
            [("toy", "all", None, "adamw"), ("tied", "all", None, "sgd"), ("toy", "none", None, "sgd")],
        ),
        "ddp2026": ((3,), [("toy", "all", None, "adamw"), ("tied", "none", None, "sgd")]),
        "bucketed": (
            (2, 4),
            [
                ("toy", "rank0", 0.0005, "sgd"),
                ("tied", "all", 0.0005, "adamw"),
                ("tied", "none", 100.0, "sgd"),
            ],
        ),
    }
    for family, (sizes, rows) in beyond.items():
        for ws in sizes:
            for model, extra, mb, opt in rows:
                knobs = {"steps": 3, "global_batch": 2 * ws, "optimizer": opt, "extra": extra}
                knobs |= BEYOND_DDP_CHECKS
                if mb is not None:
                    knobs["bucket_mb"] = mb
                cases.append(_ddp(family, BEYOND, ws, model, FLOAT64, **knobs))
    return cases


# Sharded optimizer: ``draw`` is the batches' distribution (torch.rand or torch.randn); ``params_as`` what
# the hook is handed (the generator ``model.parameters()``, or ``groups``' list or groups); ``loss``;
# ``every_step``: parameters compared every step (else the last only); ``ranks_agree``: all ranks end
# with identical weights; ``state_ownership``: each parameter's optimizer state sits on exactly one rank
# and equals the unsharded optimizer's.
SHARDED_CHECKS = ("draw", "params_as", "loss", "every_step", "ranks_agree", "state_ownership")
# The course's sharded-optimizer run: the same model and batch (32 x 10 -> 5, uniform) on every rank,
# sum-of-squares loss, AdamW(lr=0.1, weight_decay=0.1), 10 steps; numpy's assert_allclose (rtol=1e-7).
COURSE_SHARDED = {
    "steps": 10,
    "batch": 32,
    "optimizer": "adamw-course",
    "groups": "one-group",
    "add_after": None,
    "draw": "uniform",
    "params_as": "generator",
    "loss": "sum-of-squares",
    "every_step": False,
    "ranks_agree": False,
    "state_ownership": False,
}
BEYOND_SHARDED = {
    "draw": "normal",
    "params_as": "groups",
    "loss": "mse",
    "every_step": True,
    "ranks_agree": True,
    "state_ownership": True,
}


def _sharded(tier: str, ws: int, model: str, tol: Tolerance, **knobs: Any) -> Case:
    add = knobs.get("add_after")
    cid = f"sharded-{tier}-ws{ws}-{model}-{knobs['optimizer']}-{knobs['groups']}" + (
        f"-add{add}" if add is not None else ""
    )
    return _trained(cid, "sharded", SHARDED_HOOKS, tier, ws, model, tol, knobs)


def _sharded_cases() -> list[Case]:
    numpy_close = Tolerance(0.0, 1e-7, source="the course's numpy assert_allclose defaults")
    cases = [_sharded(COURSE, 2, m, numpy_close, **COURSE_SHARDED) for m in ("course-toy", "course-tied")]
    for ws in (2, 3):
        for opt, groups, add in (
            ("adamw", "groups", 2),
            ("sgd-momentum", "one-group", None),
            ("sgd-momentum", "groups", 1),
        ):
            knobs = {"steps": 4, "batch": 4, "optimizer": opt, "groups": groups, "add_after": add}
            knobs |= BEYOND_SHARDED
            cases.append(_sharded(BEYOND, ws, "toy", FLOAT64, **knobs))
    return cases


# The course's FSDP runs (test_fsdp.py): an Embedding -> RMSNorm -> Linear -> ReLU -> RMSNorm -> Linear ->
# Linear model of the student's own cs336_basics layers (vocab 100, d_model 64, d_ff 128), a batch of 20
# sequences of 8 split over 2 ranks, cross-entropy on the last position, SGD(lr=0.01), 3 steps; and one
# backward of out.sum() on different data per rank, whose replicated gradients must be bitwise equal.
COURSE_FSDP_SIZES = (100, 64, 128)
FSDP_CHECKS = ("state_checked",)
FSDP_TOL = {
    # The course compares fp32 with torch.equal in one process; across processes with fresh inputs the
    # half-batch sums round differently, so fp32 allows that rounding (and a sum over ranks is 2x off).
    (COURSE, "fp32"): Tolerance(
        1e-6, 1e-4, source="torch.equal in the course's process; rounding of the split batch here"
    ),
    (COURSE, "fp16"): Tolerance(1e-4, 1e-4, source="the course's torch.allclose(atol=1e-4, rtol=1e-4)"),
    (BEYOND, "fp32"): Tolerance(1e-5, 1e-5),
    (BEYOND, "fp16"): Tolerance(1e-4, 1e-4),
    (BEYOND, "bf16"): Tolerance(1e-3, 1e-3),
}


def _fsdp(tier: str, ws: int, dtype: str, check: str, opt: str, sizes: tuple[int, int, int]) -> Case:
    rules = TIERS[tier]
    return Case(
        id=f"fsdp-{tier}-{check}-ws{ws}-{dtype}-{opt}",
        family="fsdp",
        hooks=FSDP_HOOKS,
        tier=tier,
        device=rules.trained_device,
        dtype=dtype,
        tolerance=FSDP_TOL[(tier, dtype)],
        world_size=ws,
        model="layers",
        knobs={
            "check": check,
            "optimizer": opt,
            "sizes": sizes,
            "steps": 3,
            "global_batch": rules.fsdp_batch,
            "state_checked": rules.state_checked,
        },
    )


def _fsdp_cases() -> list[Case]:
    cases = [
        _fsdp(COURSE, 2, dt, check, "sgd-0.01", COURSE_FSDP_SIZES)
        for check in ("train", "grad-sync")
        for dt in ("fp32", "fp16")
    ]
    for ws in (2, 3):
        for dt, opt in (
            ("fp32", "sgd-0.01"),
            ("fp32", "adamw-0.01"),
            ("fp16", "sgd-0.01"),
            ("bf16", "sgd-0.01"),
        ):
            cases.append(_fsdp(BEYOND, ws, dt, "train", opt, (19, 7, 13)))
    return cases


CASES: dict[str, Case] = {
    c.id: c for c in [*_attention_cases(), *_ddp_cases(), *_sharded_cases(), *_fsdp_cases()]
}
FAMILIES = ("attention", "ddp", "sharded", "fsdp")


def of_family(family: str) -> list[Case]:
    return [c for c in CASES.values() if c.family == family]


def hook_groups(tier: str) -> list[str]:
    """The hook groups (a case's first hook) with cases in ``tier``, in the table's order."""
    return list(dict.fromkeys(c.hooks[0] for c in CASES.values() if c.tier == tier))
