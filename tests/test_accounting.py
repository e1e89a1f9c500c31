"""Every closed-form answer of cs336_systems.accounting against a hand derivation written out here.

The expected numbers are computed in the test from the handout's constants by hand arithmetic (never
by calling the function under test again), so a wrong formula in accounting/ fails.
"""

from __future__ import annotations

import math

import pytest

from cs336_systems import accounting as acc
from cs336_systems.model import PRESETS
from cs336_systems.report import answers

# ---------------------------------------------------------------- D5d / D5e


@pytest.mark.parametrize("ctx, mib", [(128, 5), (256, 10), (512, 20)])
def test_residual_stream_2p7b(ctx: int, mib: int) -> None:
    # batch 4 · ctx · d_model 2560 · 4 bytes; 4·2560·4 = 40,960 bytes per position = 40 KiB.
    expected = 4 * ctx * 2560 * 4
    assert acc.residual_stream_bytes(PRESETS["2.7B"], ctx) == expected
    assert expected / 2**20 == mib


def test_largest_forward_tensors_2p7b_ctx512() -> None:
    sizes = acc.largest_forward_tensors(PRESETS["2.7B"], 512)
    # scores: 4 batch · 32 heads · 512² · 4 B = 128 MiB; logits: 4·512·10,000·4 = 81,920,000 B.
    assert next(iter(sizes)) == "attention scores (one layer)"
    assert sizes["attention scores (one layer)"] == 128 * 2**20
    assert sizes["logits"] == 81_920_000
    assert sizes["feed-forward hidden (one layer)"] == 4 * 512 * 10240 * 4  # 80 MiB
    assert list(sizes.values()) == sorted(sizes.values(), reverse=True)


# ---------------------------------------------------------------- D6


def test_attention_memory_16384_d16() -> None:
    m = acc.attention_memory(seq=16384, d=16)
    # One 8 × 16384 × 16384 fp32 matrix: 8 · 2^28 · 4 = 2^33 bytes = 8 GiB.
    assert m.score_matrix == 2**33
    # (8, 16384, 16) fp32: 8 · 2^14 · 2^4 · 4 = 2^23 bytes = 8 MiB.
    assert m.vector_tensor == 2**23
    assert m.saved_for_backward == 2**33 + 3 * 2**23
    assert m.before_backward == 2**33 + 4 * 2**23
    assert m.backward_peak == 3 * 2**33 + 8 * 2**23  # P, dP, dS: 24 GiB + 64 MiB
    assert m.peak == m.backward_peak


def test_attention_memory_grows_quadratically() -> None:
    small, big = acc.attention_memory(4096, 64), acc.attention_memory(8192, 64)
    assert big.score_matrix == 4 * small.score_matrix
    ratio = big.saved_for_backward / small.saved_for_backward
    assert 3.9 < ratio <= 4.0  # the linear q, k, v terms pull it just under 4


def test_no_d6_case_ooms_on_80gib_but_32768_does() -> None:
    # Largest grid case: 3 · 8 GiB + 8 · 64 MiB (d 128) ≈ 24.5 GiB < 80 GiB.
    assert acc.smallest_oom_case(80 * 2**30) is None
    first = acc.first_oom_seq(80 * 2**30)
    # seq 32768: one matrix = 8 · 2^30 · 4 B = 32 GiB; backward needs 3 of them = 96 GiB > 80 GiB, while
    # the forward's 2 (64 GiB) would still fit.
    assert first.seq == 32768
    assert first.score_matrix == 32 * 2**30
    assert first.forward_peak < 80 * 2**30 < first.backward_peak


def test_smallest_oom_case_on_a_small_card() -> None:
    # On a 16 GiB card: seq 8192 peaks at 3 · 2 GiB + small = fits; seq 16384 needs 24 GiB: first is (16384, 16).
    case = acc.smallest_oom_case(16 * 2**30)
    assert case is not None and (case.seq, case.d) == (16384, 16)


def test_render_d6_mentions_the_measured_case() -> None:
    text = answers.render_d6(measured_oom=(16384, 32))
    assert "seq 16384, d 32" in text and "8,192.0 MiB" in text


# ---------------------------------------------------------------- D17b


def test_ddp_overhead_hand_case() -> None:
    # s = 1 GB, w = 100 GB/s, o = 100 µs: s/w = 10 ms of bandwidth time.
    s, w, o = 1e9, 1e11, 1e-4
    # n_b* = sqrt(1e9 / (1e11 · 1e-4)) = sqrt(100) = 10 buckets of 100 MB.
    assert acc.optimal_bucket_count(s, w, o) == pytest.approx(10)
    assert acc.optimal_bucket_bytes(s, w, o) == pytest.approx(1e8)
    # overhead(10) = 1e9/(10·1e11) + 10·1e-4 = 1 ms + 1 ms = 2 ms = 2·sqrt(s·o/w).
    assert acc.ddp_overhead_s(s, w, o, 10) == pytest.approx(2e-3)
    assert acc.minimal_ddp_overhead_s(s, w, o) == pytest.approx(2e-3)
    # One bucket: the whole all-reduce after backward, 10 ms + 0.1 ms.
    assert acc.ddp_overhead_s(s, w, o, 1) == pytest.approx(10.1e-3)
    # 100 buckets: 0.1 ms + 10 ms; both sides of the optimum are worse.
    assert acc.ddp_overhead_s(s, w, o, 100) == pytest.approx(10.1e-3)


def test_ddp_overhead_rejects_nonsense() -> None:
    with pytest.raises(ValueError, match="n_b"):
        acc.ddp_overhead_s(1e9, 1e11, 1e-4, 0)
    with pytest.raises(ValueError, match="per-call cost"):
        acc.optimal_bucket_bytes(1e9, 1e11, 0.0)


def test_fit_allreduce_cost_recovers_latency_and_bandwidth() -> None:
    # t = 30 µs + n / 300 GB/s, sampled at 1 MB .. 1 GB.
    sizes = [1e6, 1e7, 1e8, 1e9]
    times = [30e-6 + n / 3e11 for n in sizes]
    o, w = acc.fit_allreduce_cost(sizes, times)
    assert o == pytest.approx(30e-6, rel=1e-6)
    assert w == pytest.approx(3e11, rel=1e-9)
    with pytest.raises(ValueError):
        acc.fit_allreduce_cost([1e6], [1e-3])
    # Noise that puts the line below the origin: no per-call cost resolved, reported as 0.
    assert acc.fit_allreduce_cost([1e6, 1e7], [1e-4, 5e-3])[0] == 0.0


# ---------------------------------------------------------------- D18


def test_xxl_memory_and_h100_count() -> None:
    m = acc.XXL()
    # 2 linears · 16384 · 53248 · 126 blocks; 16384 · 53248 = 872,415,232.
    params = 2 * 872_415_232 * 126
    assert params == 219_848_638_464
    assert m.params == params
    assert m.state_bytes == 16 * params == 3_517_578_215_424
    # 3.5176e12 / 80e9 = 43.97 -> 44 cards.
    assert m.devices_to_hold(80e9) == 44
    # bf16 inputs of both linears: (16384 + 53248) · 126 · 2 = 69,632 · 252 = 17,547,264 bytes per token.
    assert m.activation_bytes_per_token == 17_547_264


def test_xxl_fsdp_shards() -> None:
    m = acc.XXL()
    # Activations ignored: 3.5176e12 / 95e9 = 37.03 -> 38 devices.
    assert m.min_fsdp(95e9) == 38
    assert m.fsdp_bytes_per_device(38) == pytest.approx(3_517_578_215_424 / 38)
    # 1024 tokens: A = 17,968,398,336 B; A/2 = 8,984,199,168 replicated.
    a = 1024 * 17_547_264
    assert a == 17_968_398_336
    # N > (3,517,578,215,424 + 8,984,199,168) / (95e9 − 8,984,199,168) = 3,526,562,414,592 / 86,015,800,832 = 40.999…
    n = m.min_fsdp(95e9, tokens=1024)
    assert n == 41
    assert m.fsdp_bytes_per_device(41, 1024) < 95e9 < m.fsdp_bytes_per_device(40, 1024)
    with pytest.raises(ValueError, match="replicated half"):
        m.min_fsdp(95e9, tokens=20_000)  # A/2 = 175 GB


def test_fsdp_tp_compute_bound_batch() -> None:
    cb = acc.fsdp_tp_compute_bound()
    alpha = 4.6e14 / 1.8e11  # 2555.56
    assert cb.alpha == pytest.approx(alpha)
    # FSDP term: X·α/M_X = 16 · 2555.56 / 2 = 20,444.4; TP share: Y·α/(F·M_Y) = 4 · 2555.56 / 53248 = 0.19197.
    batch = 20444.444 / (1 - 0.191974)
    assert cb.batch_tokens == pytest.approx(batch, rel=1e-5)  # 25,301.7 tokens
    assert cb.per_device_tokens == pytest.approx(batch / 64, rel=1e-5)  # 395.3
    assert cb.per_device_tokens_int == 396
    assert cb.batch_tokens_int == 396 * 64 == 25_344


def test_fsdp_tp_rejects_tp_bound_mesh() -> None:
    # Y·α/(F·M_Y) >= 1: with F = 8192 and Y = 4, 4·2555.6/8192 = 1.25 -> comm bound at any batch.
    with pytest.raises(ValueError, match="tensor-parallel"):
        acc.fsdp_tp_compute_bound(d_ff=8192)


# ---------------------------------------------------------------- D20


def test_xl_model_memory_unsharded_and_sharded() -> None:
    phi = 1_998_235_200  # SPEC: xl parameter count
    full = acc.model_memory(PRESETS["xl"])
    assert (full.params, full.grads, full.optim_state) == (4 * phi, 4 * phi, 8 * phi)
    sharded = acc.model_memory(PRESETS["xl"], world_size=2, sharded=True)
    assert sharded.params == 4 * phi and sharded.grads == 4 * phi
    # Half the AdamW state, up to one tensor of imbalance (the largest tensors are 16M-element embeddings).
    assert 8 * phi / 2 <= sharded.optim_state <= 8 * (phi / 2 + 16_000_000)
    assert sharded.optim_state / full.optim_state <= 0.55  # the target ratio, here by construction


def test_greedy_shards_hand_case() -> None:
    # Largest first to the least loaded: 7 -> r0, 5 -> r1, 4 -> r1 (5 < 7), 3 -> r0 (7 < 9), 1 -> r1 (9 < 10).
    assert acc.greedy_shards([3, 7, 1, 5, 4], 2) == [10, 10]
    assert acc.greedy_shards([8, 1, 1], 2) == [8, 2]
    assert acc.greedy_shards([1, 1, 1], 4) == [1, 1, 1, 0]


def test_sharding_communication_xl_two_ranks() -> None:
    phi_bytes = 4 * 1_998_235_200  # 7,992,940,800 B
    comm = acc.sharding_communication(1_998_235_200, 2)
    # N = 2: (N−1)/N = 1/2. DDP all-reduce 2·Φ/2 = Φ; ZeRO-1 Φ/2 + Φ/2 = Φ; ours Φ + Φ/2.
    assert comm.ddp == pytest.approx(phi_bytes)
    assert comm.zero1 == pytest.approx(phi_bytes)
    assert comm.ours == pytest.approx(1.5 * phi_bytes)
    four = acc.sharding_communication(1000, 4, bytes_per_element=1)
    assert (four.ddp, four.zero1, four.ours) == pytest.approx((1500, 1500, 2250))


def test_renderers_produce_the_numbers() -> None:
    assert "20 MiB" in answers.render_d5()
    d18 = answers.render_d18()
    assert "**44 H100 80GB**" in d18 and "**N_FSDP = 38**" in d18 and "396 tokens" in d18
    assert "25,344" in d18
    d17 = answers.render_d17(1e9, 1e11, 1e-4, "hand case")
    assert "n_b* = 10.0" in d17 and "overhead* = 2.00 ms" in d17
    d20 = answers.render_d20()
    assert "1,998,235,200" in d20 and "11.99 GB" in d20 and "7.99 GB" in d20
    assert math.isclose(acc.XXL().state_bytes / 1e12, 3.5176, rel_tol=1e-4)


# ---- D24(a): FSDP's expected peak saving ------------------------------------------------------------
def test_fsdp_saving_xl_two_ranks() -> None:
    """xl on 2 ranks: the state halves (16 B/param -> 8), less a working set of a few of the largest
    layer (the 10000 x 1600 embedding / LM head); the saving is just under half of DDP's state."""
    from cs336_systems.accounting.fsdp import fsdp_saving
    from cs336_systems.model import count_parameters, get_preset

    s = fsdp_saving("xl", world_size=2)
    assert s.num_params == count_parameters(get_preset("xl"))
    assert s.ddp_state_bytes == 16 * s.num_params
    assert s.largest_unit == 10000 * 1600
    # all xl matrix row counts are even: the shard is exactly half; the norm gains stay whole
    assert s.fsdp_state_bytes == 16 * (s.sharded_params // 2 + s.num_params - s.sharded_params)
    assert s.working_set_bytes == max(3 * s.largest_unit * 2, 3 * s.largest_unit * 2 + 2 * s.largest_unit * 4)
    assert 0.45 < s.saving_share < 0.5
    assert s.saving_bytes == s.ddp_state_bytes - s.fsdp_state_bytes - s.working_set_bytes


def test_fsdp_saving_grows_with_world_size_and_pads() -> None:
    from cs336_systems.accounting.fsdp import fsdp_saving
    from cs336_systems.model import get_preset

    shares = [fsdp_saving("xl", world_size=n).saving_share for n in (1, 2, 4, 8)]
    assert shares[0] == 0.0 and shares == sorted(shares) and shares[-1] < 7 / 8
    # 3 ranks do not divide 1600 rows: padding makes the shard a little more than a third
    s = fsdp_saving(get_preset("tiny"), world_size=3)
    assert s.fsdp_state_bytes > 16 * (s.sharded_params / 3 + s.num_params - s.sharded_params)
