"""A step-by-step simulator of the ring collectives and of the FFN under DP, FSDP, TP and 2D sharding.

It checks :mod:`cs336_systems.accounting.parallelism` by doing the work: N simulated devices hold numpy
arrays, every collective really moves chunks from a device to its ring successor and adds them, and
every matmul is counted. Under the W-egress model a step lasts (largest bytes a device sends in it)/W;
groups of one collective (e.g. the Y FSDP groups of a 2D mesh) run their steps in lockstep.

Arithmetic is done in the arrays' own dtype (float64 in the tests, so sharded and unsharded results can
be compared tightly), while bytes are counted at ``bytes_per_value`` per element (2: the handout's fp16).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from cs336_systems.accounting.parallelism import FP16

Groups = Sequence[Sequence[int]]
Buffers = dict[int, np.ndarray]


@dataclass
class PassCounters:
    """What each device did in one pass: FLOPs, bytes sent, and the communication time per axis."""

    flops: np.ndarray
    bytes_sent: dict[str, np.ndarray]  # axis tag -> bytes per device
    comm_s: dict[str, float] = field(default_factory=lambda: defaultdict(float))  # axis tag -> seconds

    def total_bytes(self) -> np.ndarray:
        return sum(self.bytes_sent.values(), np.zeros_like(self.flops))


class Cluster:
    """N devices with egress W bytes/s. ``phase`` names the pass the counters go to."""

    def __init__(self, n: int, w: float, bytes_per_value: int = FP16) -> None:
        if n < 1:
            raise ValueError(f"a cluster needs at least one device, got n={n}")
        self.n, self.w, self.bytes_per_value = n, w, bytes_per_value
        self.phase = "forward"
        self.passes: dict[str, PassCounters] = {}
        self.step_log: list[tuple[str, str, str, np.ndarray]] = []  # (phase, tag, collective, bytes/device)

    def counters(self, phase: str | None = None) -> PassCounters:
        phase = phase or self.phase
        if phase not in self.passes:
            self.passes[phase] = PassCounters(np.zeros(self.n), defaultdict(lambda: np.zeros(self.n)))
        return self.passes[phase]

    # --------------------------------------------------------------------------------- compute
    def mm(self, dev: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
        """a @ b on device ``dev``, counting 2·m·k·n FLOPs."""
        (m, k), (k2, n) = a.shape, b.shape
        if k != k2:
            raise ValueError(f"matmul shapes {a.shape} @ {b.shape} do not match")
        self.counters().flops[dev] += 2 * m * k * n
        return a @ b

    # ---------------------------------------------------------------------------- communication
    def _check_groups(self, groups: Groups, buffers: Buffers) -> int:
        sizes = {len(g) for g in groups}
        if len(sizes) != 1:
            raise ValueError(f"groups of one collective must have the same size, got sizes {sorted(sizes)}")
        members = [d for g in groups for d in g]
        if len(set(members)) != len(members) or not all(0 <= d < self.n for d in members):
            raise ValueError(f"groups must be disjoint sets of devices in [0, {self.n}), got {groups}")
        missing = [d for d in members if d not in buffers]
        if missing:
            raise ValueError(f"no buffer for devices {missing}")
        return sizes.pop()

    def _ring_step(
        self, name: str, tag: str, groups: Groups, outgoing: Callable[[int, int], tuple[int, np.ndarray]]
    ) -> list[tuple[int, int, np.ndarray]]:
        """One lockstep step: the device at position ``pos`` of each group sends ``outgoing(pos, dev)``
        = (chunk index, array) to its ring successor. Returns the deliveries (receiver, chunk, array)
        for the caller to apply once every device has sent, and charges max(bytes sent)/W."""
        sent, deliveries = np.zeros(self.n), []
        for group in groups:
            for pos, dev in enumerate(group):
                chunk, payload = outgoing(pos, dev)
                sent[dev] += payload.size * self.bytes_per_value
                deliveries.append((group[(pos + 1) % len(group)], chunk, payload.copy()))
        counters = self.counters()
        counters.bytes_sent[tag] += sent
        counters.comm_s[tag] += sent.max() / self.w
        self.step_log.append((self.phase, tag, name, sent))
        return deliveries

    def reduce_scatter(self, buffers: Buffers, groups: Groups, tag: str) -> Buffers:
        """Ring reduce-scatter: the flattened buffers of a group are cut in k chunks; the device at
        position i ends with chunk i summed over the group. Step s: position i sends its running chunk
        (i − s − 1) mod k to position i + 1, which adds it to its own."""
        k = self._check_groups(groups, buffers)
        chunks = {d: _split(buffers[d], k, "reduce-scatter") for g in groups for d in g}
        for step in range(k - 1):
            out = lambda pos, dev, s=step: ((pos - s - 1) % k, chunks[dev][(pos - s - 1) % k])
            for dst, c, payload in self._ring_step("reduce-scatter", tag, groups, out):
                chunks[dst][c] += payload
        return {d: chunks[d][pos] for g in groups for pos, d in enumerate(g)}

    def all_gather(self, shards: Buffers, groups: Groups, tag: str) -> Buffers:
        """Ring all-gather of equal flat shards: step s, position i forwards chunk (i − s) mod k; every
        device ends with the k shards concatenated in group order."""
        k = self._check_groups(groups, shards)
        sizes = {shards[d].size for g in groups for d in g}
        if len(sizes) != 1:
            raise ValueError(f"all-gather needs equal shard sizes, got {sorted(sizes)}")
        have: dict[int, list[np.ndarray | None]] = {d: [None] * k for g in groups for d in g}
        for g in groups:
            for pos, d in enumerate(g):
                have[d][pos] = shards[d].reshape(-1).copy()
        for step in range(k - 1):
            out = lambda pos, dev, s=step: ((pos - s) % k, have[dev][(pos - s) % k])
            for dst, c, payload in self._ring_step("all-gather", tag, groups, out):
                have[dst][c] = payload
        return {d: np.concatenate(have[d]) for d in have}

    def all_reduce(self, buffers: Buffers, groups: Groups, tag: str) -> Buffers:
        """Ring all-reduce = reduce-scatter then all-gather; results keep the buffers' shapes."""
        reduced = self.reduce_scatter(buffers, groups, tag)
        full = self.all_gather(reduced, groups, tag)
        return {d: full[d].reshape(buffers[d].shape) for d in full}

    def alternate_all_reduce(self, buffers: Buffers, groups: Groups, tag: str) -> Buffers:
        """The alternate ring: each step every device sends the whole buffer it last received (its own
        first) to its successor, which adds it to its sum and forwards it next step; k − 1 steps."""
        k = self._check_groups(groups, buffers)
        total = {d: buffers[d].copy() for g in groups for d in g}
        outgoing = dict(total)
        for _ in range(k - 1):
            for dst, _c, payload in self._ring_step(
                "alternate all-reduce", tag, groups, lambda pos, dev: (0, outgoing[dev])
            ):
                total[dst] = total[dst] + payload
                outgoing[dst] = payload
        return total


def _split(buffer: np.ndarray, k: int, what: str) -> list[np.ndarray]:
    flat = buffer.reshape(-1)
    if flat.size % k:
        raise ValueError(f"{what}: a buffer of {flat.size} values does not split into {k} equal chunks")
    return [c.copy() for c in np.split(flat, k)]


# ---------------------------------------------------------------------------------------------- FFN


def silu(u: np.ndarray) -> np.ndarray:
    return u / (1 + np.exp(-u))


def silu_grad(u: np.ndarray) -> np.ndarray:
    s = 1 / (1 + np.exp(-u))
    return s * (1 + u * (1 - s))


@dataclass(frozen=True)
class FFNWeights:
    w1: np.ndarray  # D × D_FF
    w2: np.ndarray  # D × D_FF
    w3: np.ndarray  # D_FF × D

    @property
    def dims(self) -> tuple[int, int]:
        return self.w1.shape


@dataclass(frozen=True)
class FFNResult:
    """y = FFN(x) and the gradients of Σ y ⊙ dy, all assembled to their full (unsharded) shapes."""

    y: np.ndarray
    dx: np.ndarray
    dw1: np.ndarray
    dw2: np.ndarray
    dw3: np.ndarray


def _forward(cl: Cluster, dev: int, x: np.ndarray, w1, w2, w3):
    x1, x2 = cl.mm(dev, x, w1), cl.mm(dev, x, w2)
    z = silu(x1) * x2
    return cl.mm(dev, z, w3), (x, x1, x2, z)


def _backward(cl: Cluster, dev: int, dy: np.ndarray, cache, w1, w2, w3):
    x, x1, x2, z = cache
    dw3 = cl.mm(dev, z.T, dy)
    dz = cl.mm(dev, dy, w3.T)
    dx2 = dz * silu(x1)
    dx1 = dz * x2 * silu_grad(x1)
    dw1, dw2 = cl.mm(dev, x.T, dx1), cl.mm(dev, x.T, dx2)
    dx = cl.mm(dev, dx1, w1.T) + cl.mm(dev, dx2, w2.T)
    return dx, dw1, dw2, dw3


@dataclass
class ShardedRun:
    result: FFNResult
    cluster: Cluster


def _rows(b: int, parts: int, what: str) -> list[slice]:
    if b % parts:
        raise ValueError(f"{what}: batch {b} does not split evenly over {parts} devices")
    step = b // parts
    return [slice(i * step, (i + 1) * step) for i in range(parts)]


def _replicated(buffers: Buffers, devices: Sequence[int] | range, what: str) -> np.ndarray:
    """The value every device in ``devices`` holds after a collective (they must agree bitwise)."""
    first, *rest = devices
    if not all(np.array_equal(buffers[first], buffers[d]) for d in rest):
        raise RuntimeError(f"{what}: devices {list(devices)} disagree after the collective")
    return buffers[first]


def run_reference(x: np.ndarray, ws: FFNWeights, dy: np.ndarray, w: float = 1.0) -> ShardedRun:
    """The unsharded FFN on one device."""
    return run_dp(x, ws, dy, 1, w)


def run_dp(x: np.ndarray, ws: FFNWeights, dy: np.ndarray, n: int, w: float) -> ShardedRun:
    """Data parallel: full weights everywhere, B/N tokens per device, gradients all-reduced."""
    cl = Cluster(n, w)
    rows = _rows(x.shape[0], n, "DP")
    outs, grads = {}, {}
    for dev, r in enumerate(rows):
        outs[dev], cache = _forward(cl, dev, x[r], ws.w1, ws.w2, ws.w3)
        grads[dev] = cache
    cl.phase = "backward"
    dxs, dws = {}, {}
    for dev, r in enumerate(rows):
        dxs[dev], *dws[dev] = _backward(cl, dev, dy[r], grads[dev], ws.w1, ws.w2, ws.w3)
    group = [list(range(n))]
    summed = [cl.all_reduce({d: dws[d][i] for d in range(n)}, group, "weights") for i in range(3)]
    result = FFNResult(
        np.concatenate([outs[d] for d in range(n)]),
        np.concatenate([dxs[d] for d in range(n)]),
        *(_replicated(g, range(n), "DP gradient") for g in summed),
    )
    return ShardedRun(result, cl)


def run_fsdp(x: np.ndarray, ws: FFNWeights, dy: np.ndarray, n: int, w: float) -> ShardedRun:
    """FSDP over N devices: the 2D mesh with N_TP = 1."""
    return run_fsdp_tp(x, ws, dy, n, 1, w)


def run_tp(x: np.ndarray, ws: FFNWeights, dy: np.ndarray, n: int, w: float) -> ShardedRun:
    """Tensor parallel over N devices: the 2D mesh with N_FSDP = 1."""
    return run_fsdp_tp(x, ws, dy, 1, n, w)


def run_fsdp_tp(
    x: np.ndarray, ws: FFNWeights, dy: np.ndarray, n_fsdp: int, n_tp: int, w: float
) -> ShardedRun:
    """X × Y mesh, device (p, q) = p·Y + q: tokens split over p, W1/W2 columns and W3 rows split over q
    (tensor parallel), and each device's TP shard flat-split over p (FSDP).

    forward:  all-gather the TP shards over p ("weights"), local FFN, all-reduce y over q ("activations");
    backward: all-gather again, local backward, all-reduce dx over q, reduce-scatter dW over p.
    """
    X, Y = n_fsdp, n_tp
    d, d_ff = ws.dims
    if d_ff % Y:
        raise ValueError(f"TP: d_ff {d_ff} does not split evenly over {Y} devices")
    cl = Cluster(X * Y, w)
    rows, cols = _rows(x.shape[0], X, "FSDP"), _rows(d_ff, Y, "TP")
    dev = lambda p, q: p * Y + q
    fsdp_groups = [[dev(p, q) for p in range(X)] for q in range(Y)]
    tp_groups = [[dev(p, q) for q in range(Y)] for p in range(X)]
    tp_shards = [(ws.w1[:, c], ws.w2[:, c], ws.w3[c, :]) for c in cols]
    local = {  # what each device stores between steps: its FSDP piece of its TP shard of each weight
        dev(p, q): [_split(t, X, "FSDP shard")[p] for t in tp_shards[q]] for p in range(X) for q in range(Y)
    }
    shapes = [(d, d_ff // Y), (d, d_ff // Y), (d_ff // Y, d)]

    def gather() -> dict[int, list[np.ndarray]]:
        full = [cl.all_gather({k: v[i] for k, v in local.items()}, fsdp_groups, "weights") for i in range(3)]
        return {k: [full[i][k].reshape(shapes[i]) for i in range(3)] for k in local}

    weights = gather()
    partial, caches = {}, {}
    for p in range(X):
        for q in range(Y):
            k = dev(p, q)
            partial[k], caches[k] = _forward(cl, k, x[rows[p]], *weights[k])
    y = cl.all_reduce(partial, tp_groups, "activations")
    del weights  # freed after forward; backward gathers again

    cl.phase = "backward"
    weights = gather()
    dx_partial, dws = {}, {}
    for p in range(X):
        for q in range(Y):
            k = dev(p, q)
            dx_partial[k], *dws[k] = _backward(cl, k, dy[rows[p]], caches[k], *weights[k])
    dx = cl.all_reduce(dx_partial, tp_groups, "activations")
    grad_pieces = [
        cl.reduce_scatter({k: v[i] for k, v in dws.items()}, fsdp_groups, "weights") for i in range(3)
    ]

    def assemble(i: int) -> np.ndarray:
        shards = [
            np.concatenate([grad_pieces[i][dev(p, q)] for p in range(X)]).reshape(shapes[i]) for q in range(Y)
        ]
        return np.concatenate(shards, axis=1 if i < 2 else 0)

    row = lambda bufs, p, what: _replicated(bufs, [dev(p, q) for q in range(Y)], what)
    result = FFNResult(
        np.concatenate([row(y, p, "TP output y") for p in range(X)]),
        np.concatenate([row(dx, p, "TP input gradient dx") for p in range(X)]),
        assemble(0),
        assemble(1),
        assemble(2),
    )
    return ShardedRun(result, cl)


RUNNERS: dict[str, Callable[..., ShardedRun]] = {"DP": run_dp, "FSDP": run_fsdp, "TP": run_tp}


def pass_times(run: ShardedRun, c: float, network: str) -> dict[str, tuple[float, float]]:
    """(compute s, communication s) of each pass on the slowest device, as the simulator measured them:
    communication per axis summed ("shared") or the larger axis ("overlapped")."""
    out = {}
    for phase, counters in run.cluster.passes.items():
        per_axis = list(counters.comm_s.values()) or [0.0]
        comm = sum(per_axis) if network == "shared" else max(per_axis)
        out[phase] = (counters.flops.max() / c, comm)
    return out


def comm_bound(run: ShardedRun, c: float, network: str = "shared") -> bool:
    """Is any pass of the simulated step communication-bound?"""
    return any(comm > compute for compute, comm in pass_times(run, c, network).values())
