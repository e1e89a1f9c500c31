"""Closed-form answers of the 2026 parallelism questions (D25): collectives, DP, FSDP, TP and 2D.

The handout's model, and the assumptions we add where it leaves a choice:

- N devices, every pair linked; each device sends at most W bytes/s in total (egress) and receives as
  fast. A step of a collective lasts (largest bytes any device sends in it) / W; steps run back to back
  and latency is ignored. Compute runs at C FLOP/s; values (weights, activations, gradients) are fp16,
  2 bytes each.
- The FFN: x1 = x·W1, x2 = x·W2, z = f(x1) ⊙ x2, y = z·W3 with x: B × D, W1, W2: D × D_FF,
  W3: D_FF × D. B is the *global* batch in tokens. Only matmuls count as FLOPs (2 per multiply-add):
  forward 3 matmuls = 6·B·D·D_FF, backward 6 matmuls (dW and dx of each) = 12·B·D·D_FF; the elementwise
  f and ⊙ are ignored, and dx is computed (the FFN sits inside a network).
- Gradients are summed over the batch (a mean only rescales them).
- "Communication-bound": a pass is communication-bound when its communication time exceeds its compute
  time (communication assumed perfectly overlapped with compute, the optimistic bound); a step is when
  its forward or its backward pass is. Collectives of one axis (DP/FSDP weights, TP activations) run
  one after another on the device's egress.
- 2D: N = N_FSDP · N_TP = X · Y devices on an X × Y mesh; the batch is split over X, the weights are
  tensor-parallel over Y and each TP shard is further FSDP-sharded over X. "Overlapped": the FSDP and
  the TP collectives run at the same time without slowing each other (communication time = the larger
  of the two), as when W limits each link rather than a device's total egress (the two axes use
  disjoint links of the full mesh); "shared": they share the egress W (communication time = their sum).

Symbols in the ``formulas`` strings: S (bytes), N, W, C, B, D, D_FF, X = N_FSDP, Y = N_TP. Every function
returns numbers; the report prints the formulas next to them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

FP16 = 2  # bytes per value
Network = Literal["overlapped", "shared"]
NETWORKS: tuple[Network, ...] = ("overlapped", "shared")


def _check_positive(**values: float) -> None:
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{name} must be positive, got {value}")


# --------------------------------------------------------------------------------------- collectives


@dataclass(frozen=True)
class Collective:
    """One collective on N devices: the bytes each device sends, the ring steps and the time."""

    name: str
    n: int
    s: float  # bytes of the full buffer (per device for all-reduce, gathered size for the others)
    steps: int
    bytes_per_device: float
    time_s: float
    formula: str  # the time, symbolically


def _collective(name: str, s: float, n: int, w: float, steps: int, per_device: float, formula: str):
    _check_positive(s=s, n=n, w=w)
    return Collective(name, n, s, steps, per_device, per_device / w, formula)


def ring_reduce_scatter(s: float, n: int, w: float) -> Collective:
    """Ring reduce-scatter of an S-byte buffer: N−1 steps, each device sends one S/N chunk per step."""
    return _collective("reduce-scatter", s, n, w, n - 1, (n - 1) * s / n, "(N-1)/N · S/W")


def ring_all_gather(s: float, n: int, w: float) -> Collective:
    """Ring all-gather into an S-byte buffer (S/N per device): N−1 steps of one S/N chunk."""
    return _collective("all-gather", s, n, w, n - 1, (n - 1) * s / n, "(N-1)/N · S/W")


def ring_all_reduce(s: float, n: int, w: float) -> Collective:
    """Ring all-reduce = reduce-scatter + all-gather: 2(N−1) steps of S/N bytes, 2(N−1)/N · S/W.

    Bandwidth-optimal: every device must send at least (N−1)/N·S (its contribution to the N−1 chunks it
    does not own) and receive as much again for the result.
    """
    return _collective("all-reduce", s, n, w, 2 * (n - 1), 2 * (n - 1) * s / n, "2(N-1)/N · S/W")


def alternate_ring_all_reduce(s: float, n: int, w: float) -> Collective:
    """The alternate ring all-reduce: every device sends its whole S-byte buffer to its ring successor;
    each step a device adds what it received to its running sum and forwards that received buffer
    unchanged. After N−1 steps every device has seen every other device's buffer, so each holds the sum.

    Time (N−1)·S/W: N/2 times the reduce-scatter + all-gather ring (2(N−1)/N·S/W), equal only at N = 2,
    because each step moves whole buffers instead of 1/N chunks.
    """
    return _collective("alternate all-reduce", s, n, w, n - 1, (n - 1) * s, "(N-1) · S/W")


# ------------------------------------------------------------------------------------ FFN strategies


@dataclass(frozen=True)
class PassCost:
    """One pass (forward or backward) on one device: FLOPs and the bytes it sends on each axis."""

    flops: float
    weight_bytes: float  # DP all-reduce / FSDP all-gather + reduce-scatter (weights and their gradients)
    activation_bytes: float  # TP all-reduces of activations
    c: float
    w: float

    @property
    def compute_s(self) -> float:
        return self.flops / self.c

    def comm_s(self, network: Network = "shared") -> float:
        if network == "shared":
            return (self.weight_bytes + self.activation_bytes) / self.w
        if network == "overlapped":
            return max(self.weight_bytes, self.activation_bytes) / self.w
        raise ValueError(f"network must be one of {NETWORKS}, got {network!r}")

    def comm_bound(self, network: Network = "shared") -> bool:
        return self.comm_s(network) > self.compute_s


@dataclass(frozen=True)
class StrategyCalcs:
    """A strategy on N devices: per-device costs of each pass and the largest N it scales to."""

    name: str
    n: int
    forward: PassCost
    backward: PassCost
    max_devices: int  # largest N (for 2D: N_FSDP · N_TP under ``network``) not communication-bound
    formulas: dict[str, str] = field(default_factory=dict)
    backward_equations: tuple[str, ...] = ()
    network: Network = "shared"

    def comm_bound(self, network: Network | None = None) -> bool:
        net = network or self.network
        return self.forward.comm_bound(net) or self.backward.comm_bound(net)


def ffn_flops(b: int, d: int, d_ff: int) -> tuple[int, int]:
    """(forward, backward) matmul FLOPs of the whole FFN on a batch of b tokens: 6·b·D·D_FF, 12·b·D·D_FF."""
    return 6 * b * d * d_ff, 12 * b * d * d_ff


def alpha(c: float, w: float) -> float:
    """C/W: the FLOPs a device must do per byte it sends to stay compute-bound."""
    _check_positive(c=c, w=w)
    return c / w


def _floor(x: float) -> int:
    # Guard against 4.999999 from float division of an exact ratio.
    return math.floor(x + 1e-9)


def dp_max_devices(b: int, c: float, w: float) -> int:
    """DP (and FSDP): backward 12·B·D·D_FF/(N·C) ≥ 2(N−1)/N · 6·D·D_FF/W ⇔ N − 1 ≤ B·W/C."""
    return 1 + _floor(b / alpha(c, w))


def tp_max_devices(d_ff: int, c: float, w: float, pass_: str = "step") -> int:
    """TP: forward 6·B·D·D_FF/(N·C) ≥ 2(N−1)/N · 2·B·D/W ⇔ N − 1 ≤ 3·D_FF·W/(2C); backward has twice the
    FLOPs for the same all-reduce: N − 1 ≤ 3·D_FF·W/C. The step is bound by the forward pass."""
    k = {"forward": 1.5, "step": 1.5, "backward": 3.0}[pass_]
    return 1 + _floor(k * d_ff / alpha(c, w))


def _check_counts(n: int, **sizes: int) -> None:
    if n < 1:
        raise ValueError(f"device count must be >= 1, got {n}")
    for name, size in sizes.items():
        if size < 1:
            raise ValueError(f"{name} must be >= 1, got {size}")


def data_parallel_calcs(n: int, b: int, d: int, d_ff: int, c: float, w: float) -> StrategyCalcs:
    """Data parallel on N devices, global batch B: each device holds all of W1, W2, W3 and B/N tokens.

    Forward: 6·B·D·D_FF/N FLOPs, no communication. Backward: 12·B·D·D_FF/N FLOPs, then an all-reduce of
    the 3·D·D_FF fp16 gradient values (S = 6·D·D_FF bytes): 2(N−1)/N · 6·D·D_FF/W. Not communication-bound
    while 12·B·D·D_FF/(N·C) ≥ 12(N−1)·D·D_FF/(N·W), i.e. N ≤ 1 + B·W/C (independent of D, D_FF).
    """
    _check_counts(n, b=b, d=d, d_ff=d_ff)
    fwd, bwd = ffn_flops(b, d, d_ff)
    grads = 3 * d * d_ff * FP16
    return StrategyCalcs(
        "DP",
        n,
        PassCost(fwd / n, 0.0, 0.0, c, w),
        PassCost(bwd / n, ring_all_reduce(grads, n, w).bytes_per_device, 0.0, c, w),
        dp_max_devices(b, c, w),
        {
            "forward FLOPs": "6·B·D·D_FF/N",
            "backward FLOPs": "12·B·D·D_FF/N",
            "forward communication": "0",
            "backward communication": "2(N-1)/N · 6·D·D_FF/W",
            "largest N": "1 + ⌊B·W/C⌋",
        },
    )


def fsdp_calcs(n: int, b: int, d: int, d_ff: int, c: float, w: float) -> StrategyCalcs:
    """FSDP on N devices: each device holds 1/N of every weight and B/N tokens.

    Forward: all-gather each weight before use (3·D·D_FF fp16 values gathered: (N−1)/N · 6·D·D_FF/W) and
    6·B·D·D_FF/N FLOPs. Backward: gather the (freed) weights again and reduce-scatter the gradients:
    2(N−1)/N · 6·D·D_FF/W, with 12·B·D·D_FF/N FLOPs. Both passes give N − 1 ≤ B·W/C: the same limit as
    DP, the weight traffic being 1.5× DP's but spread over a forward pass with half the backward FLOPs.
    """
    return _mesh_calcs("FSDP", n, 1, b, d, d_ff, c, w, "shared")


def tp_calcs(n: int, b: int, d: int, d_ff: int, c: float, w: float) -> StrategyCalcs:
    """Tensor parallel on N devices: W1, W2 split by columns and W3 by rows (D_FF/N of each per device);
    x (B × D) is replicated. Device i computes x1ᵢ = x·W1ᵢ, x2ᵢ = x·W2ᵢ, zᵢ = f(x1ᵢ) ⊙ x2ᵢ and the partial
    yᵢ = zᵢ·W3ᵢ; y = Σᵢ yᵢ is one all-reduce of B·D fp16 values: 2(N−1)/N · 2·B·D/W.

    Backward (dy replicated; see ``backward_equations``) needs one all-reduce of dx = Σᵢ dxᵢ, the same
    2(N−1)/N · 2·B·D/W; the weight gradients stay local. FLOPs 6·B·D·D_FF/N forward, 12·B·D·D_FF/N
    backward. Forward: N − 1 ≤ 3·D_FF·W/(2C), backward: N − 1 ≤ 3·D_FF·W/C (independent of B).
    """
    return _mesh_calcs("TP", 1, n, b, d, d_ff, c, w, "shared")


TP_BACKWARD_EQUATIONS = (
    "dW3ᵢ = zᵢᵀ·dy  (D_FF/N × D, local)",
    "dzᵢ = dy·W3ᵢᵀ  (B × D_FF/N)",
    "dx2ᵢ = dzᵢ ⊙ f(x1ᵢ)",
    "dx1ᵢ = dzᵢ ⊙ x2ᵢ ⊙ f'(x1ᵢ)",
    "dW1ᵢ = xᵀ·dx1ᵢ,  dW2ᵢ = xᵀ·dx2ᵢ  (D × D_FF/N, local)",
    "dx = Σᵢ (dx1ᵢ·W1ᵢᵀ + dx2ᵢ·W2ᵢᵀ)  (all-reduce of B × D)",
)


def fsdp_tp_calcs(
    n_fsdp: int, n_tp: int, b: int, d: int, d_ff: int, c: float, w: float, network: Network = "shared"
) -> StrategyCalcs:
    """2D: X = N_FSDP, Y = N_TP, N = X·Y. Per device and pass:

    forward:  FLOPs 6·B·D·D_FF/N; FSDP all-gather of its TP shard (3·D·D_FF/Y values) over X:
              6(X−1)·D·D_FF/(N·W); TP all-reduce of its B/X tokens over Y: 4(Y−1)·B·D/(N·W).
    backward: FLOPs 12·B·D·D_FF/N; all-gather + reduce-scatter over X: 12(X−1)·D·D_FF/(N·W);
              TP all-reduce of dx: 4(Y−1)·B·D/(N·W).

    With α = C/W the forward pass binds (it has half the FLOPs and all of the TP traffic):
    overlapped: X − 1 ≤ B/α and Y − 1 ≤ 3·D_FF/(2α), so N_max is the product of the DP and TP limits;
    shared: (X−1)/B + 2(Y−1)/(3·D_FF) ≤ 1/α, whose continuous optimum is
    X* = (1 + B/α + 2B/(3·D_FF))/2, Y* = (1 + 3·D_FF/(2α) + 3·D_FF/(2B))/2; ``max_devices`` is the exact
    integer optimum (:func:`fsdp_tp_max_devices`).
    """
    return _mesh_calcs("FSDP+TP", n_fsdp, n_tp, b, d, d_ff, c, w, network)


def _mesh_calcs(
    name: str, x: int, y: int, b: int, d: int, d_ff: int, c: float, w: float, network: Network
) -> StrategyCalcs:
    _check_counts(x, b=b, d=d, d_ff=d_ff)
    _check_counts(y)
    n = x * y
    fwd, bwd = ffn_flops(b, d, d_ff)
    shard = 3 * d * d_ff * FP16 / y  # bytes of this device's TP shard of the three weights
    gather = ring_all_gather(shard, x, w).bytes_per_device
    scatter = ring_reduce_scatter(shard, x, w).bytes_per_device
    act = ring_all_reduce(b * d * FP16 / x, y, w).bytes_per_device
    forward = PassCost(fwd / n, gather, act, c, w)
    backward = PassCost(bwd / n, gather + scatter, act, c, w)
    if name == "FSDP":
        max_n = dp_max_devices(b, c, w)
        formulas = {
            "forward FLOPs": "6·B·D·D_FF/N",
            "backward FLOPs": "12·B·D·D_FF/N",
            "forward communication": "(N-1)/N · 6·D·D_FF/W  (all-gather)",
            "backward communication": "2(N-1)/N · 6·D·D_FF/W  (all-gather + reduce-scatter)",
            "largest N": "1 + ⌊B·W/C⌋",
        }
        return StrategyCalcs(name, n, forward, backward, max_n, formulas)
    if name == "TP":
        formulas = {
            "forward FLOPs": "6·B·D·D_FF/N",
            "backward FLOPs": "12·B·D·D_FF/N",
            "forward communication": "2(N-1)/N · 2·B·D/W  (all-reduce y)",
            "backward communication": "2(N-1)/N · 2·B·D/W  (all-reduce dx)",
            "largest N (forward binds)": "1 + ⌊3·D_FF·W/(2C)⌋",
            "largest N (backward alone)": "1 + ⌊3·D_FF·W/C⌋",
        }
        return StrategyCalcs(
            name, n, forward, backward, tp_max_devices(d_ff, c, w), formulas, TP_BACKWARD_EQUATIONS
        )
    formulas = {
        "forward FLOPs": "6·B·D·D_FF/N",
        "backward FLOPs": "12·B·D·D_FF/N",
        "forward communication (FSDP, TP)": "6(X-1)·D·D_FF/(N·W),  4(Y-1)·B·D/(N·W)",
        "backward communication (FSDP, TP)": "12(X-1)·D·D_FF/(N·W),  4(Y-1)·B·D/(N·W)",
        "overlapped: time": "max(FSDP, TP)",
        "shared: time": "FSDP + TP",
        "largest N, overlapped": "(1 + ⌊B·W/C⌋)·(1 + ⌊3·D_FF·W/(2C)⌋)",
        "largest N, shared": "max over X of X·(1 + ⌊(3·D_FF/2)·(W/C − (X−1)/B)⌋)",
        "optimal split, shared (continuous)": "X* = (1 + B·W/C + 2B/(3·D_FF))/2,  Y* = (1 + 3·D_FF·W/(2C) + 3·D_FF/(2B))/2",
        "optimal split at a given N, shared": "X* = √(2·B·N/(3·D_FF))",
    }
    max_n = fsdp_tp_max_devices(b, d_ff, c, w, network).n
    return StrategyCalcs(name, n, forward, backward, max_n, formulas, network=network)


# ------------------------------------------------------------------------------------------ 2D split


@dataclass(frozen=True)
class Split:
    n_fsdp: int
    n_tp: int
    x_continuous: float  # the real-valued optimum of the closed form (before rounding)
    y_continuous: float

    @property
    def n(self) -> int:
        return self.n_fsdp * self.n_tp


def _tp_limit_given_x(x: int, b: int, d_ff: int, a: float, network: Network) -> int:
    """Largest Y with the forward pass of an X × Y mesh not communication-bound (0 if none)."""
    if network == "overlapped":
        return 1 + _floor(1.5 * d_ff / a) if x - 1 <= b / a + 1e-9 else 0
    room = 1 / a - (x - 1) / b
    return 1 + _floor(1.5 * d_ff * room) if room >= -1e-12 else 0


def fsdp_tp_max_devices(b: int, d_ff: int, c: float, w: float, network: Network = "shared") -> Split:
    """The X × Y split with the most devices such that no pass is communication-bound.

    The forward pass binds (see :func:`fsdp_tp_calcs`); Y is at its largest for each X, and we search the
    X ≤ 1 + B/α integers. Ties go to the larger X (less activation traffic per token).
    """
    if network not in NETWORKS:
        raise ValueError(f"network must be one of {NETWORKS}, got {network!r}")
    a = alpha(c, w)
    x_max = 1 + _floor(b / a)
    best = max(
        ((x, _tp_limit_given_x(x, b, d_ff, a, network)) for x in range(1, x_max + 1)),
        key=lambda xy: (xy[0] * xy[1], xy[0]),
    )
    if network == "overlapped":
        xc, yc = 1 + b / a, 1 + 1.5 * d_ff / a
    else:
        xc = (1 + b / a + b / (1.5 * d_ff)) / 2
        yc = (1 + 1.5 * d_ff / a + 1.5 * d_ff / b) / 2
    return Split(best[0], best[1], xc, yc)


def fsdp_tp_split_for(
    n: int, b: int, d: int, d_ff: int, c: float, w: float, network: Network = "shared"
) -> Split:
    """For a given N, the divisor split X·Y = N with the least communication per compute in the binding
    (forward) pass. Shared network: minimise 3·D_FF·(X−1) + 2·B·(N/X − 1), continuous X* = √(2·B·N/(3·D_FF));
    overlapped: balance 3·D_FF·(X−1) = 2·B·(N/X − 1)."""
    _check_counts(n)
    splits = [(x, n // x) for x in range(1, n + 1) if n % x == 0]

    def ratio(xy: tuple[int, int]) -> float:
        f = fsdp_tp_calcs(*xy, b, d, d_ff, c, w, network).forward
        return f.comm_s(network) / f.compute_s

    best = min(splits, key=ratio)
    if network == "shared":
        xc = math.sqrt(2 * b * n / (3 * d_ff))
    else:  # 3F·X² − (3F − 2B)·X − 2B·N = 0
        p, q = 3 * d_ff, 2 * b
        xc = ((p - q) + math.sqrt((p - q) ** 2 + 4 * p * q * n)) / (2 * p)
    return Split(best[0], best[1], xc, n / xc)


def max_devices(strategy: str, b: int, d_ff: int, c: float, w: float) -> int:
    """Largest device count before communication-bound, by strategy name: DP, FSDP, TP,
    "2D overlapped", "2D shared" (what the report plots against B)."""
    if strategy in ("DP", "FSDP"):
        return dp_max_devices(b, c, w)
    if strategy == "TP":
        return tp_max_devices(d_ff, c, w)
    if strategy.startswith("2D "):
        return fsdp_tp_max_devices(b, d_ff, c, w, strategy[3:]).n  # type: ignore[arg-type]
    raise ValueError(f"unknown strategy {strategy!r} (DP, FSDP, TP, '2D overlapped', '2D shared')")
