"""The leaderboard's rules on the CPU: the parent's clock over iterations it verifies (a stand-in
workload: the fixture's Triton kernel under Triton's interpreter, in fp32 at a small shape), the ranking
rules as a pure function, the kernels read from a repository's source, the observer's report, and the
class report's leaderboard. The GPU runs of the same fixtures: ``test_leaderboard_gpu.py``."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

from cs336_systems.grading.class_run import class_report
from cs336_systems.grading.judge.kernel_names import kernels_in, repository_kernels
from cs336_systems.grading.repo.leaderboard import clock, standing
from cs336_systems.grading.repo.leaderboard import row as leaderboard
from cs336_systems.grading.repo.leaderboard.observer import Observed, parse, phases
from cs336_systems.grading.roots import discover
from cs336_systems.grading.shared.clock import FIELDS, iterations

FIXTURE = Path(__file__).resolve().parents[1] / "data" / "students" / "leaderboard"
SHAPE = (2, 128, 16)  # the stand-in's shape: tiles of 64 divide it
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def fixture_modules():
    """The fixture's package imported under private names (never as ``cs336_systems``)."""
    mods = {}
    for name in ("flash", "tricks"):
        spec = importlib.util.spec_from_file_location(
            f"lbfix_{name}", FIXTURE / "cs336_systems" / f"{name}.py"
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules[f"cs336_systems.{name}"] = mod  # tricks imports `from cs336_systems import flash`
        spec.loader.exec_module(mod)
        mods[name] = mod
    yield mods
    for name in ("flash", "tricks"):
        sys.modules.pop(f"cs336_systems.{name}", None)


def _round(call, seed: int = 1234, count: int = 3) -> str | None:
    prints = iterations(lambda q, k, v: call(q, k, v, True), seed, count, SHAPE, CPU, "fp32")
    return clock.verify(prints, clock.Round(seed, count, 1.0), SHAPE, CPU, "fp32")


def test_honest_iterations_verify(fixture_modules) -> None:
    assert _round(fixture_modules["flash"].FlashAttention.apply) is None


@pytest.mark.parametrize(
    ("trick", "bad"),
    [("SkipsEveryOther", "1 of 3"), ("Precomputed", "3 of 3"), ("WrongButFast", "3 of 3")],
)
def test_skipped_precomputed_or_wrong_iterations_fail(fixture_modules, trick: str, bad: str) -> None:
    why = _round(getattr(fixture_modules["tricks"], trick).apply)
    assert why is not None and why.startswith(bad), why


def test_another_seed_is_not_this_rounds_work(fixture_modules) -> None:
    """Results of other inputs (computed before the seed was known) never pass for this round's."""
    flash = fixture_modules["flash"].FlashAttention.apply
    prints = iterations(lambda q, k, v: flash(q, k, v, True), 99, 2, SHAPE, CPU, "fp32")
    assert clock.verify(prints, clock.Round(100, 2, 1.0), SHAPE, CPU, "fp32") is not None


def _shifted(field: str, by: float, seed: int = 7, count: int = 2) -> str | None:
    """A round whose fingerprints are the reference's but for ``field``, moved by ``by`` times its
    projected norm (the judge's yardstick) in every iteration and batch row."""
    ref = iterations(lambda q, k, v: clock.sdpa(q, k, v), seed, count, SHAPE, CPU, "fp32", scales=True)
    prints = ref[:, 0].clone()
    at = FIELDS.index(field)
    prints[:, at] += by * ref[:, 1, at]
    return clock.verify(prints, clock.Round(seed, count, 1.0), SHAPE, CPU, "fp32")


@pytest.mark.parametrize("field", FIELDS)
def test_every_fingerprint_is_checked_within_a_tenth_of_its_norm(field: str) -> None:
    """dQ, dK, dV and O each on its own: within 0.1 of the projected norm passes (bf16 rounding moves a
    fingerprint by about 0.01 of it), beyond it fails naming the field (docs/grading.md)."""
    assert _shifted(field, 0.08) is None
    why = _shifted(field, 0.12)
    assert why is not None and why.startswith("2 of 2") and f"{field} off by more than 0.1" in why, why
    assert _shifted(field, -0.12) is not None


def test_a_malformed_fingerprint_record_is_refused() -> None:
    assert "not a tensor" in (clock.verify("garbage", clock.Round(1, 2, 1.0), SHAPE, CPU, "fp32") or "")
    nan = torch.full((2, 4, SHAPE[0]), math.nan)
    assert "non-finite" in (clock.verify(nan, clock.Round(1, 2, 1.0), SHAPE, CPU, "fp32") or "")


def test_the_parents_clock_times_a_worker_and_verifies_it() -> None:
    """One real round trip: the worker warms up, waits for the seed, runs, hands back; the time is
    this process's and every iteration verified (the stand-in: fp32, eager, no course figure)."""
    plan = clock.ClockPlan(calibration=2, min_iterations=2, max_iterations=2, target_ms=1.0, wait_s=240)
    row = leaderboard.row(
        discover(FIXTURE / "tests" / "adapters_skip.py"),
        {"cases": [{"id": "c", "tier": "course", "hooks": [standing_hook()], "status": "passed"}]},
        plan,
        device="cpu",
        observe=False,
        shape=SHAPE,
        compile=False,
        dtype="fp32",
    )
    assert row["iterations"] == 2
    assert "1 of 2 timed iterations do not match" in row["unranked_because"], row
    assert row["parent_ms"] is None and not row["ranked"]


def standing_hook() -> str:
    return leaderboard.TRITON_HOOK


# -- the ranking rules, a pure function ------------------------------------------------------------------


def _evidence(**kw) -> standing.Evidence:
    base = dict(course_failures=[], clock_problem=None, parent_ms=10.0, course_ms=10.2, floor_ms=1.0)
    observed = Observed.of_phases(
        {"lb_fwd_kernel": 3.0}, {"lb_bwd_dkdv_kernel": 6.0, "triton_poi_fused_sum_0": 0.1}
    )
    if "observed" in kw and kw["observed"] is not None and "phases" not in kw:
        kw["phases"] = phases(kw["observed"], 1)
    base |= dict(
        observed=observed,
        observed_iterations=1,
        repo_kernels={"lb_fwd_kernel", "lb_bwd_dkdv_kernel"},
        phases=phases(observed, 1),
    )
    return standing.Evidence(**(base | kw))


def test_an_honest_observed_row_is_ranked() -> None:
    row = standing.standing(_evidence())
    assert row["ranked"], row["unranked_because"]
    assert row["attribution"] == "observed (ncu)" and row["repository_share"] > 0.98
    assert row["agreement"].startswith("agree")


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"course_failures": ["course-triton-match"]}, "fails the course tier (course-triton-match)"),
        ({"course_failures": None}, "course tier was not graded"),
        ({"parent_ms": math.nan}, "no time on the parent's clock"),
        ({"parent_ms": -1.0}, "no time on the parent's clock"),
        ({"parent_ms": 0.5}, "below 1.000 ms"),
        ({"clock_problem": "2 of 40 timed iterations do not match"}, "2 of 40"),
        ({"course_ms": 0.1}, "own do_bench reported 0.100 ms"),
        ({"parent_ms": 4.0}, "less than the 9.100 ms its own kernels take under the observer"),
        (
            {"observed": Observed.of_phases({"lb_fwd_kernel": 0.1, "flash_fwd_kernel_cudnn": 9.0}, {})},
            "a library's attention ran in the forward: flash_fwd_kernel_cudnn",
        ),
        ({"observed": Observed({})}, "saw no GPU work"),
        (
            {"observed": Observed.of_phases({"lb_fwd_kernel": 1.0}, {"lb_bwd_dkdv_kernel": 1.0})},
            "the observer saw 2.002 ms of GPU work per call of the 10.000 ms timed: work was hidden",
        ),
    ],
)
def test_each_rule_unranks_and_names_why(change: dict, reason: str) -> None:
    row = standing.standing(_evidence(**change))
    assert not row["ranked"]
    assert reason in row["unranked_because"], row["unranked_because"]


# Each rule's threshold, as docs/grading.md states it, held on both sides: the observed GPU time at least
# half the parent's (COVERAGE), the timed run not below 0.85 of its kernels under the observer
# (OBSERVED_SLACK), the course figure not under half the parent's (CLAIM_LIMIT), the two figures within
# 10% (AGREEMENT). The stand-in observed 9.102 ms a call, 9.1 of it the repository's work.
@pytest.mark.parametrize(
    ("change", "ranked", "why"),
    [
        ({"parent_ms": 9.102 / 0.49, "course_ms": 9.102 / 0.49}, False, "work was hidden from it"),
        ({"parent_ms": 9.102 / 0.51, "course_ms": 9.102 / 0.51}, True, None),
        ({"parent_ms": 0.84 * 9.1, "course_ms": 0.84 * 9.1}, False, "the timed work is not the observed"),
        ({"parent_ms": 0.86 * 9.1, "course_ms": 0.86 * 9.1}, True, None),
        ({"course_ms": 4.9}, False, "own do_bench reported 4.900 ms, under 0.5x"),
        ({"course_ms": 5.1}, True, None),
    ],
)
def test_each_rules_threshold_is_the_documented_one(change: dict, ranked: bool, why: str | None) -> None:
    row = standing.standing(_evidence(**change))
    assert row["ranked"] == ranked, row["unranked_because"]
    assert why is None or why in row["unranked_because"], row["unranked_because"]


@pytest.mark.parametrize(("course_ms", "agree"), [(10.9, True), (11.1, False), (9.1, True), (8.9, False)])
def test_the_two_figures_agree_within_ten_percent(course_ms: float, agree: bool) -> None:
    row = standing.standing(_evidence(course_ms=course_ms))
    assert row["agreement"].startswith("agree") == agree, row["agreement"]


def test_the_two_figures_disagreeing_is_said_not_hidden() -> None:
    row = standing.standing(_evidence(course_ms=12.5))
    assert row["ranked"] and row["agreement"].startswith("DISAGREE")


def test_without_an_observer_the_record_is_self_reported_and_a_malformed_one_unranks() -> None:
    row = standing.standing(_evidence(observed=None, self_record="garbage"))
    assert row["attribution"] == "self-reported" and not row["ranked"]
    assert "no usable record" in row["unranked_because"] or "provenance" in row["unranked_because"]


def test_observed_rows_rank_above_self_reported_ones_and_untimed_rows_never_rank() -> None:
    rows = [
        {"name": "self", "ranked": True, "parent_ms": 1.0, "attribution": "self-reported"},
        {"name": "slow", "ranked": True, "parent_ms": 9.0, "attribution": "observed (ncu)"},
        {"name": "fast", "ranked": True, "parent_ms": 3.0, "attribution": "observed (ncu)"},
        {"name": "nan", "ranked": True, "parent_ms": math.nan, "attribution": "observed (ncu)"},
        {"name": "none", "ranked": True, "parent_ms": None, "attribution": "observed (ncu)"},
    ]
    assert [r["name"] for r in standing.order(rows)] == ["fast", "slow", "self"]


# -- kernels from source, the observer's report ---------------------------------------------------------


def test_kernel_names_are_read_from_source_without_importing_it(tmp_path: Path) -> None:
    (tmp_path / "k.py").write_text(
        "raise SystemExit('never imported')\n"
        "import triton\nfrom triton import jit\n"
        "@triton.jit\ndef a(x): pass\n"
        "@triton.autotune(configs=[], key=[])\n@triton.jit(do_not_specialize=['n'])\ndef b(x, n): pass\n"
        "@jit\ndef c(x): pass\n"
        "@triton.jit\ndef triton_tem_fused_flex_attention_0(x): pass\n"
        "def not_a_kernel(x): pass\n"
    )
    (tmp_path / ".venv").mkdir()
    (tmp_path / ".venv" / "v.py").write_text("import triton\n@triton.jit\ndef vendored(x): pass\n")
    assert repository_kernels([tmp_path]) == {"a", "b", "c"}
    assert kernels_in("def broken(:") == set()


def test_the_worker_counts_no_kernel_of_an_environment_inside_the_repository(tmp_path: Path) -> None:
    """The worker's record of the repository's kernels (the modules it loaded from the repository's
    folders) leaves out an environment there, as uv's ``.venv`` or tox's ``.tox``: the suite's own tox
    environment sits in its folder, and every module of torch was scanned for kernels at every case."""
    import importlib.util
    import sys

    from cs336_systems.grading.worker import provenance

    kernel = "import triton\n@triton.jit\ndef {name}(x): pass\n"
    (tmp_path / "own.py").write_text(kernel.format(name="own_kernel"))
    vendored = tmp_path / ".venv" / "lib" / "site-packages" / "lib_kernels.py"
    vendored.parent.mkdir(parents=True)
    vendored.write_text(kernel.format(name="library_kernel"))
    loaded = []
    try:
        for name, path in (("cs336_probe_own", tmp_path / "own.py"), ("cs336_probe_lib", vendored)):
            spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            loaded.append(name)
            spec.loader.exec_module(module)
        assert set(provenance.repository_kernels([str(tmp_path)])) == {"own_kernel"}
    finally:
        for name in loaded:
            sys.modules.pop(name, None)


def test_the_fixture_repository_defines_its_kernels() -> None:
    assert {
        "lb_fwd_kernel",
        "lb_bwd_dkdv_kernel",
        "lb_bwd_dq_kernel",
        "token_lse_kernel",
    } <= repository_kernels([FIXTURE])


NCU_CSV = """==PROF== Connected to process 123
"ID","Process ID","Process Name","Host Name","Kernel Name","Context","Stream","Block Size","Grid Size","Device","CC","Section Name","Metric Name","Metric Unit","Metric Value"
"0","123","python3","127.0.0.1","lb_fwd_kernel","1","7","(128, 1, 1)","(256, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","msecond","3.50"
"1","123","python3","127.0.0.1","void at::native::reduce_kernel<512, 1>(int)","1","7","(512, 1, 1)","(1, 1, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","usecond","12.00"
"2","123","python3","127.0.0.1","lb_fwd_kernel","1","7","(128, 1, 1)","(256, 16, 1)","0","9.0","Command line profiler metrics","gpu__time_duration.sum","nsecond","3,500,000"
"""


def test_the_observers_report_is_read_per_kernel() -> None:
    seen = parse(NCU_CSV)
    assert seen.launches == 3
    assert seen.kernels["lb_fwd_kernel"] == pytest.approx(7.0)
    assert seen.kernels["void at::native::reduce_kernel<512, 1>(int)"] == pytest.approx(0.012)
    assert seen.share({"lb_fwd_kernel"}) == pytest.approx(7.0 / 7.012)


# -- the class report's leaderboard ----------------------------------------------------------------------


def test_the_class_leaderboard_ranks_only_what_the_rules_allow(tmp_path: Path) -> None:
    import json

    rows = {
        "honest": {"parent_ms": 9.0, "course_ms": 9.3, "ranked": True, "attribution": "observed (ncu)"},
        "faster-self": {"parent_ms": 5.0, "course_ms": 5.0, "ranked": True, "attribution": "self-reported"},
        "wrong": {
            "parent_ms": 2.0,
            "ranked": False,
            "unranked_because": "the Triton hook fails the course tier",
        },
        "no-time": {"parent_ms": None, "ranked": True, "attribution": "observed (ncu)"},
        "nan": {"parent_ms": math.nan, "ranked": True, "attribution": "observed (ncu)"},
    }
    for name, lb in rows.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "leaderboard.json").write_text(json.dumps(lb))
    (tmp_path / "anchors").mkdir()
    anchor = {"rows": [{"name": "cuDNN (SDPA)", "parent_ms": 4.5, "course_ms": 4.4, "agreement": "agree"}]}
    (tmp_path / "anchors" / "gpu0.json").write_text(json.dumps(anchor))
    board = class_report.leaderboard(
        class_report.collect(tmp_path, list(rows)), class_report.anchors(tmp_path)
    )
    assert [(b["rank"], b["name"]) for b in board] == [
        ("1", "honest"),
        ("2", "faster-self"),
        ("no rank", "wrong"),
        ("no rank", "no-time"),
        ("no rank", "nan"),
        ("ref", "cuDNN (SDPA)"),
    ]
    assert class_report.chart(board, tmp_path / "lb.png") is not None
    class_report.write(tmp_path, list(rows))
    assert "the Triton hook fails the course tier" in (tmp_path / "class.md").read_text()


# -- the Triton hook's course tier on a GPU: the forward is the repository's own -------------------------


def _record(forward: dict[str, float], backward: dict[str, float] | None = None) -> dict:
    return {
        "launched": [["lb_fwd_kernel", str(FIXTURE / "cs336_systems" / "flash.py")]],
        "repository_kernels": {},
        "operators": [],
        "kernels": sorted({*forward, *(backward or {})}),
        "gpu_ms": {"forward": forward, "backward": backward or {}},
    }


@pytest.mark.parametrize(
    ("forward", "backward", "fails"),
    [
        ({"lb_fwd_kernel": 0.020, "void at::vectorized_elementwise_kernel<4>": 0.003}, None, False),
        ({"lb_fwd_kernel": 0.005, "void at::native::vectorized_elementwise_kernel<4>": 0.030}, None, False),
        ({"lb_fwd_kernel": 0.020}, {"sm90_xmma_gemm_f32f32_tf32": 0.5}, False),  # a PyTorch backward
        (
            {"token_lse_kernel": 0.002, "sm90_xmma_gemm_f32f32_tf32": 0.05, "softmax_warp_forward": 0.01},
            None,
            True,
        ),
    ],
)
def test_a_token_kernel_beside_borrowed_matmuls_fails_the_course_tier(forward, backward, fails) -> None:
    from cs336_systems.grading.judge import provenance

    names = {"lb_fwd_kernel", "token_lse_kernel"}
    misses = provenance.attention_misses("triton", _record(forward, backward), [FIXTURE], True, names)
    assert bool(misses) == fails, misses
    if fails:
        assert "borrowed compute (sm90_xmma_gemm_f32f32_tf32" in misses[0], misses


def test_an_observer_that_never_reached_the_worker_is_not_the_codes_fault() -> None:
    assert not parse("==PROF== ERROR: profiling lock held\n").connected
    assert parse(NCU_CSV).connected


def test_the_course_figure_is_the_mean_of_do_bench_and_a_malformed_record_is_not_ranked() -> None:
    from cs336_systems.grading.judge import provenance
    from cs336_systems.grading.worker.timing import course_figure

    assert course_figure([1.0, 1.0, 1.0, 9.0]) == pytest.approx(3.0)  # the median would say 1.0
    for garbage in ("garbage", {"launched": "x"}, None, {"launched": [], "repository_kernels": 3}):
        assert provenance.standing(garbage, [FIXTURE], 5.0, 1.0)["ranked"] is False
