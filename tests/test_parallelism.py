"""D25: the closed forms of accounting.parallelism against the step-by-step simulator, and the simulator's
collectives and sharded FFNs against plain numpy / torch autograd (float64)."""

from __future__ import annotations

import itertools
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from cs336_systems.accounting import parallelism as P
from cs336_systems.accounting import simulator as S
from cs336_systems.report.load import Record

# (N, B, D, D_FF): every size splits evenly the way DP, FSDP and TP need.
SETS_1D = [(2, 8, 4, 6), (3, 12, 5, 9), (4, 16, 6, 8), (5, 20, 4, 10), (6, 12, 3, 12), (8, 16, 8, 16)]
# (N_FSDP, N_TP, B, D, D_FF)
SETS_2D = [
    (2, 2, 8, 4, 8),
    (2, 3, 12, 4, 6),
    (3, 2, 12, 6, 8),
    (4, 2, 16, 4, 8),
    (2, 4, 8, 6, 12),
    (3, 3, 9, 3, 9),
]
CLOSED = {"DP": P.data_parallel_calcs, "FSDP": P.fsdp_calcs, "TP": P.tp_calcs}
C, W = 3.0e3, 7.0  # arbitrary units: only C/W matters for the bound, and both must scale the times


def _problem(b: int, d: int, d_ff: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    ws = S.FFNWeights(
        rng.standard_normal((d, d_ff)), rng.standard_normal((d, d_ff)), rng.standard_normal((d_ff, d))
    )
    return rng.standard_normal((b, d)), ws, rng.standard_normal((b, d))


# ------------------------------------------------------------------------------------- collectives


@pytest.mark.parametrize("n", [2, 3, 4, 5, 7])
def test_ring_collectives_move_and_reduce_the_data(n: int) -> None:
    rng = np.random.default_rng(n)
    size = 6 * n  # values per device buffer
    s = size * P.FP16  # bytes, as the closed forms count them
    bufs = {d: rng.standard_normal((2, 3 * n)) for d in range(n)}
    total = sum(bufs.values())
    group = [list(range(n))]

    cl = S.Cluster(n, W)
    scattered = cl.reduce_scatter(bufs, group, "t")
    for d in range(n):  # device d owns chunk d of the sum
        np.testing.assert_allclose(scattered[d], np.split(total.reshape(-1), n)[d], rtol=1e-13)
    gathered = cl.all_gather(scattered, group, "t")
    reduced = S.Cluster(n, W).all_reduce(bufs, group, "t")
    alternate = S.Cluster(n, W).alternate_all_reduce(bufs, group, "t")
    for d in range(n):
        np.testing.assert_allclose(gathered[d], total.reshape(-1), rtol=1e-13)
        np.testing.assert_allclose(reduced[d], total, rtol=1e-13)
        np.testing.assert_allclose(alternate[d], total, rtol=1e-13)
    # The per-step, per-device byte counts and the times of each algorithm against its closed form.
    for algo, closed, per_step in [
        ("reduce_scatter", P.ring_reduce_scatter, s / n),
        ("all_reduce", P.ring_all_reduce, s / n),
        ("alternate_all_reduce", P.alternate_ring_all_reduce, s),
    ]:
        cl = S.Cluster(n, W)
        getattr(cl, algo)(bufs, group, "t")
        expect = closed(s, n, W)
        steps = [sent for *_, sent in cl.step_log]
        assert len(steps) == expect.steps
        assert all(np.allclose(sent, per_step) for sent in steps)
        assert cl.counters().comm_s["t"] == pytest.approx(expect.time_s, rel=1e-12)
        assert cl.counters().bytes_sent["t"] == pytest.approx(np.full(n, expect.bytes_per_device), rel=1e-12)
    assert P.ring_all_reduce(s, n, W).formula == "2(N-1)/N · S/W"
    assert P.alternate_ring_all_reduce(s, n, W).time_s == pytest.approx(
        n / 2 * P.ring_all_reduce(s, n, W).time_s
    )


def test_concurrent_groups_run_in_lockstep() -> None:
    """Two disjoint groups of 3 cost the time of one: each device's egress is its own."""
    bufs = {d: np.arange(6.0) + d for d in range(6)}
    cl = S.Cluster(6, W)
    out = cl.all_reduce(bufs, [[0, 2, 4], [1, 3, 5]], "t")
    np.testing.assert_array_equal(out[2], bufs[0] + bufs[2] + bufs[4])
    np.testing.assert_array_equal(out[5], bufs[1] + bufs[3] + bufs[5])
    assert cl.counters().comm_s["t"] == pytest.approx(P.ring_all_reduce(6 * P.FP16, 3, W).time_s)


def test_bad_inputs_are_named() -> None:
    cl = S.Cluster(3, W)
    with pytest.raises(ValueError, match="does not split into 3 equal chunks"):
        cl.reduce_scatter({d: np.ones(4) for d in range(3)}, [[0, 1, 2]], "t")
    with pytest.raises(ValueError, match="disjoint"):
        cl.all_reduce({d: np.ones(3) for d in range(3)}, [[0, 1], [1, 2]], "t")
    x, ws, dy = _problem(8, 4, 6)
    with pytest.raises(ValueError, match="d_ff 6 does not split evenly over 4"):
        S.run_tp(x, ws, dy, 4, W)
    with pytest.raises(ValueError, match="batch 8 does not split evenly over 3"):
        S.run_dp(x, ws, dy, 3, W)
    with pytest.raises(ValueError, match="network"):
        P.fsdp_tp_max_devices(8, 6, C, W, "mesh")  # type: ignore[arg-type]


# -------------------------------------------------------------------------------------------- FFN


def test_reference_ffn_matches_torch_autograd() -> None:
    x, ws, dy = _problem(12, 5, 9)
    ref = S.run_reference(x, ws, dy).result
    t = {k: torch.tensor(v, requires_grad=True) for k, v in dict(x=x, w1=ws.w1, w2=ws.w2, w3=ws.w3).items()}
    y = (torch.nn.functional.silu(t["x"] @ t["w1"]) * (t["x"] @ t["w2"])) @ t["w3"]
    (y * torch.tensor(dy)).sum().backward()
    np.testing.assert_allclose(ref.y, y.detach().numpy(), rtol=1e-12)
    for name in ("x", "w1", "w2", "w3"):
        np.testing.assert_allclose(getattr(ref, "d" + name), t[name].grad.numpy(), rtol=1e-11, atol=1e-12)


def _runs():
    for strategy, (n, b, d, d_ff) in itertools.product(CLOSED, SETS_1D):
        yield strategy, (n, b, d, d_ff), lambda x, ws, dy, s=strategy, n=n: S.RUNNERS[s](x, ws, dy, n, W)
    for xx, yy, b, d, d_ff in SETS_2D:
        yield "FSDP+TP", (xx, yy, b, d, d_ff), lambda x, ws, dy, a=xx, c=yy: S.run_fsdp_tp(x, ws, dy, a, c, W)


RUNS = list(_runs())


@pytest.mark.parametrize(("strategy", "dims", "run"), RUNS, ids=[f"{s}-{d}" for s, d, _ in RUNS])
def test_sharded_ffn_matches_unsharded(strategy, dims, run) -> None:
    b, d, d_ff = dims[-3:]
    x, ws, dy = _problem(b, d, d_ff, seed=sum(dims))
    ref = S.run_reference(x, ws, dy).result
    got = run(x, ws, dy).result
    for name in ("y", "dx", "dw1", "dw2", "dw3"):
        np.testing.assert_allclose(
            getattr(got, name), getattr(ref, name), rtol=1e-11, atol=1e-11, err_msg=name
        )


@pytest.mark.parametrize(("strategy", "dims", "run"), RUNS, ids=[f"{s}-{d}" for s, d, _ in RUNS])
def test_closed_forms_equal_simulated_counts(strategy, dims, run) -> None:
    b, d, d_ff = dims[-3:]
    sim = run(*_problem(b, d, d_ff)).cluster
    for network in P.NETWORKS:
        if strategy == "FSDP+TP":
            calcs = P.fsdp_tp_calcs(*dims, C, W, network)
        else:
            calcs = CLOSED[strategy](*dims, C, W)
        for phase in ("forward", "backward"):
            closed, counters = getattr(calcs, phase), sim.counters(phase)
            assert counters.flops == pytest.approx(np.full(sim.n, closed.flops), rel=1e-12), phase
            for axis, expect in (("weights", closed.weight_bytes), ("activations", closed.activation_bytes)):
                got = counters.bytes_sent.get(axis, np.zeros(sim.n))
                assert got == pytest.approx(np.full(sim.n, expect), rel=1e-12, abs=1e-12), (phase, axis)
            compute_s, comm_s = S.pass_times(S.ShardedRun(None, sim), C, network)[phase]
            assert compute_s == pytest.approx(closed.compute_s, rel=1e-12)
            assert comm_s == pytest.approx(closed.comm_s(network), rel=1e-12, abs=1e-15), (phase, network)


# -------------------------------------------------------------- largest device counts by simulation

# Sizes that split evenly for every scanned N (1..6 and 8), every X ≤ 5 × Y ∈ SCAN_Y mesh and N = 12.
# Only C/W relative to B and D_FF sets the limits: C/W = B/3.5 gives X ≤ 4 (B·W/C = 3.5) and Y ≤ 6
# (3·D_FF·W/(2C) = 5.25); C/W = B/2.8 gives 3 and 5.
SCAN_B, SCAN_D, SCAN_F = 120, 60, 120
SCAN_N = (1, 2, 3, 4, 5, 6, 8)
SCAN_Y = (1, 2, 3, 4, 5, 6, 8)
ALPHAS = (SCAN_B / 3.5, SCAN_B / 2.8)


@pytest.fixture(scope="module")
def scan_problem():
    return _problem(SCAN_B, SCAN_D, SCAN_F, seed=1)


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("strategy", list(CLOSED))
def test_largest_n_equals_simulated_scan(strategy: str, alpha: float, scan_problem) -> None:
    """Simulate N = 1..8; the largest N whose step is not communication-bound is the closed form's."""
    c = alpha * W
    ok = [n for n in SCAN_N if not S.comm_bound(S.RUNNERS[strategy](*scan_problem, n, W), c)]
    closed = CLOSED[strategy](1, SCAN_B, SCAN_D, SCAN_F, c, W).max_devices
    assert closed < max(SCAN_N), "the scan must reach past the limit"
    assert ok == [n for n in SCAN_N if n <= closed]  # the largest that fits, and every smaller N fits


def test_largest_2d_mesh_equals_simulated_scan(scan_problem) -> None:
    """Simulate every X × Y mesh with X ≤ 5, Y ∈ SCAN_Y at C/W = B/3.5 (X ≤ 4 and Y ≤ 6 alone): the biggest
    mesh that is not communication-bound under each network model is the closed form's (4·6 = 24
    overlapped; 3·3 = 9 shared)."""
    c = ALPHAS[0] * W
    runs = {(x, y): S.run_fsdp_tp(*scan_problem, x, y, W) for x in range(1, 6) for y in SCAN_Y}
    for network, expect in (("overlapped", 24), ("shared", 9)):
        fits = [xy for xy, run in runs.items() if not S.comm_bound(run, c, network)]
        best = max(fits, key=lambda xy: (xy[0] * xy[1], xy[0]))
        split = P.fsdp_tp_max_devices(SCAN_B, SCAN_F, c, W, network)
        assert (split.n_fsdp, split.n_tp) == best
        assert split.n == expect == P.max_devices(f"2D {network}", SCAN_B, SCAN_F, c, W)
        assert P.fsdp_tp_calcs(1, 1, SCAN_B, SCAN_D, SCAN_F, c, W, network).max_devices == expect


@pytest.mark.parametrize("network", P.NETWORKS)
def test_optimal_split_for_given_n_equals_simulation(network, scan_problem) -> None:
    """At N = 12 the split with the least communication per compute (worst pass), by simulation."""
    c = ALPHAS[0] * W

    def worst_ratio(x: int) -> float:
        times = S.pass_times(S.run_fsdp_tp(*scan_problem, x, 12 // x, W), c, network)
        return max(comm / compute for compute, comm in times.values())

    best = min((1, 2, 3, 4, 6, 12), key=worst_ratio)
    split = P.fsdp_tp_split_for(12, SCAN_B, SCAN_D, SCAN_F, c, W, network)
    assert (split.n_fsdp, split.n_tp) == (best, 12 // best)
    assert split.x_continuous * split.y_continuous == pytest.approx(12)


# ------------------------------------------------------------------------------------------ report

RESULTS = Path(__file__).resolve().parents[1] / "docs" / "results"


def test_section_renders_with_measured_hardware_and_writes_plot(tmp_path: Path) -> None:
    from cs336_systems.report import parallelism as R

    rows = R._load_rows([RESULTS / "h200-model-core.json", RESULTS / "h200x4-allreduce-nccl.json"])
    hw = R.hardware(rows)
    assert hw.c == pytest.approx(787.53e12, rel=1e-4) and "measured bf16" in hw.c_source  # bf16, not fp32
    assert hw.w == pytest.approx(323.2e9, rel=1e-3) and "nccl, 2 ranks, 1,024 MiB" in hw.w_source
    text = R.parallelism_section(rows, tmp_path)
    plot = tmp_path / "plots" / R.PLOT_NAME
    assert plot.stat().st_size > 10_000 and f"]({'plots/' + R.PLOT_NAME})" in text
    assert "788 TFLOP/s" in text and "323 GB/s" in text  # three significant digits
    for formula in ("2(N-1)/N · S/W", "(N-1) · S/W", "1 + ⌊B·W/C⌋", "1 + ⌊3·D_FF·W/(2C)⌋", "dx = Σᵢ"):
        assert formula in text
    # The same rows as the report's Record objects (descriptors / values), and no rows at all.
    records = [
        Record(r["group"], None, r["name"], "s", "H200", "m", r.get("params") or {}, r["extra_info"])
        for r in rows
    ]
    assert R.hardware(records) == R.Hardware(
        hw.c, hw.w, hw.c_source.replace("NVIDIA H200", "H200"), hw.w_source.replace("NVIDIA H200", "H200")
    )
    assert "stated constant: the bf16 dense matmul rate measured on an H200" in R.parallelism_answer([])


def test_plotted_limits_compose() -> None:
    """2D overlapped is the product of the DP and TP limits; shared lies between the larger one and it."""
    from cs336_systems.report import parallelism as R

    curves = R.max_devices_curves(R.hardware([]))
    assert curves["DP"] == curves["FSDP"] and len(set(curves["TP"])) == 1
    for i, _b in enumerate(R.PLOT_BATCHES):
        assert curves["2D overlapped"][i] == curves["DP"][i] * curves["TP"][i]
        assert max(curves["DP"][i], curves["TP"][i]) <= curves["2D shared"][i] <= curves["2D overlapped"][i]
    assert curves["DP"] == sorted(curves["DP"]) and curves["DP"][-1] > 1000


def test_register_adds_section_and_plot() -> None:
    from cs336_systems.report import parallelism as R

    registered = []
    fake = SimpleNamespace(
        Section=lambda **kw: SimpleNamespace(**kw),
        register_section=registered.append,
        PLOTS=(("D13", "allreduce.png", None),),
    )
    R.register(fake)
    R.register(fake)  # idempotent on the plot list
    assert (
        registered[0].key == "D25" and registered[0].always and "Alternate ring" in registered[0].answer([])
    )
    assert [p[0] for p in fake.PLOTS] == ["D13", "D25"]
