"""kernels/flash/select.py: which kernel runs is one pure function whose refusals are recorded (no silent
fallback), bench rows name the kernels that ran, and docs/architecture.md's route table is the code's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash.select import Layouts, gluon_refusal
from cs336_systems.kernels.flash.select import facts as facts_of

from .helpers.attention import check_against_reference, make_inputs, tolerance

C = flash.TileConfig
ARCHITECTURE = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
# Gluon configs with the interpreter's tiles (a forward and a one-pass dK/dV), no descriptors.
GLUON_FWD = C(32, 16, gluon=True)
ONE_PASS_DKDV = C(16, 32, gluon=True, ws=True, one_pass=True)


def test_a_refused_gate_is_recorded_and_the_row_names_the_kernel_that_ran(device, generator) -> None:
    # Gluon and the one-pass backward forced on a ragged length (100: no tile multiple) on a machine
    # where they cannot run: the Triton kernels run, and what the plan records (and a bench row copies)
    # names them, the configs as they ran, the reasons, and a dQ pass (the split backward runs).
    # Breaks tried: resolve() not recording the refusal -> fails; the plan launching the requested config
    # instead of the resolved one -> the Gluon launch fails on the CPU.
    flash.clear_tuning_cache()  # (forgets what ran, too)
    q, k, v, do = make_inputs((2, 100, 100, 64), torch.float32, device, generator)
    with flash.forced("fwd", GLUON_FWD), flash.forced("dkdv", ONE_PASS_DKDV):
        check_against_reference(
            FlashAttentionTriton.apply, q, k, v, do, True, tolerance(torch.float32, device)
        )
    case = (2, 100, 100, 64, True, torch.float32)
    ran = flash.launched(case)
    assert ran is not None and ran.backward == "split"
    assert ran.fwd.kernel == "flash_fwd_kernel" and ran.fwd.requested == GLUON_FWD
    assert ran.fwd.config == C(32, 16) and ran.fwd.refused and ran.fwd.refused[0].startswith("gluon: ")
    assert ran.dkdv.kernel == "flash_bwd_dkdv_kernel" and not ran.dkdv.config.one_pass
    assert ran.dq is not None and ran.dq.kernel == "flash_bwd_dq_kernel"
    configs = flash.chosen_configs(case)
    assert set(configs) == {"fwd", "dq", "dkdv"} and not any("gluon" in c for c in configs.values())
    row = flash.launched_info(case)["launched"]
    assert row["fwd"]["kernel"] == "flash_fwd_kernel" and row["fwd"]["requested"] == str(GLUON_FWD)
    flash.clear_tuning_cache()


def _hopper_facts(case: flash.Case) -> Layouts:
    """Contiguous bf16 tensors of ``case`` on an (imagined) Hopper GPU: meta tensors, taken as aligned."""
    t = lambda n: torch.empty(1, case.bh, n, case.d, dtype=case.dtype, device="meta")
    tensors = dict(q=t(case.n_q), k=t(case.n_k), v=t(case.n_k), do=t(case.n_q), dq=t(case.n_q))
    tensors.update(o=flash.new_output(t(case.n_q)), dk=t(case.n_k), dv=t(case.n_k))
    tensors["lse"] = torch.empty(1, case.bh, case.n_q, device="meta")
    return flash.layouts_of(True, aligned=True, **tensors)


def test_select_is_pure_and_names_every_refusal() -> None:
    case = flash.Case(16, 16384, 16384, 64, True, torch.bfloat16)
    one_pass = next(c for c in flash.gpu_candidates("dkdv", 64, torch.bfloat16) if c.one_pass)
    configs = {"fwd": C(128, 128, 4, 3, True, True, True), "dq": C(128, 64, 4, 4, True), "dkdv": one_pass}
    facts = _hopper_facts(case)
    chosen = flash.select(case, facts, configs, deterministic=False)
    assert chosen == flash.select(case, facts, configs, deterministic=False)
    assert chosen.backward == "one-pass" and chosen.dq is None
    assert chosen.dkdv.kernel == "flash_bwd_one_pass_ws_kernel" and chosen.fwd.kernel == "flash_fwd_ws_kernel"
    det = flash.select(case, facts, configs, deterministic=True)
    assert det.backward == "split" and det.dkdv.kernel == "flash_bwd_dkdv_ws_kernel" and det.dq is not None
    assert det.dkdv.refused[0].startswith("one-pass: deterministic")
    ragged = flash.Case(16, 16100, 16100, 64, True, torch.bfloat16)
    off = flash.select(ragged, _hopper_facts(ragged), configs, deterministic=False)
    assert off.fwd.kernel == "flash_fwd_kernel" and "not multiples of the tiles" in off.fwd.refused[0]
    assert off.backward == "split" and off.dkdv.kernel == "flash_bwd_dkdv_kernel"


# -- the route table of docs/architecture.md, held against select.route_for -------------------------------


def route_table() -> list[dict[str, str]]:
    """The rows of the table under "## FlashAttention routes" whose header starts with "compiling"."""
    text = ARCHITECTURE.read_text()
    section = text.split("## FlashAttention routes", 1)[1]
    lines = [line for line in section.splitlines() if line.startswith("| compiling")]
    start = section.splitlines().index(lines[0])
    rows = []
    for line in section.splitlines()[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().strip("`") for cell in line.strip("|").split("|")])
    header, body = rows[0], rows[2:]
    return [dict(zip(header, row, strict=True)) for row in body]


def _flag(cell: str) -> list[bool]:
    return {"yes": [True], "no": [False], "any": [False, True]}[cell]


def test_the_route_table_is_the_code() -> None:
    # Break tried: route_for sending eager calls under a dispatch mode to "plan" -> the row "no | yes"
    # fails; a row edited in the doc fails the same way; a case no row covers fails the count.
    rows = route_table()
    assert rows, "no route table in docs/architecture.md"
    covered = set()
    for row in rows:
        for compiling in _flag(row["compiling"]):
            for mode in _flag(row["dispatch mode"]):
                got = flash.route_for(compiling=compiling, dispatch_mode=mode)
                assert got == row["route"], (row, got)
                covered.add((compiling, mode))
    assert len(covered) == 4, "the table leaves cases out"


@pytest.mark.parametrize("name", ["leaderboard", "8B"])
def test_the_pasted_flash_explain_matches_the_code(name: str) -> None:
    # docs/architecture.md quotes flash_explain's output for two shapes; the choice it shows must still be
    # the one the code makes (an edited route, gate or table entry fails this).
    from cs336_systems.cli.flash_explain import explain

    shape = {"leaderboard": (1, 16, 16384, 64), "8B": (1, 32, 32768, 128)}[name]
    text = ARCHITECTURE.read_text()
    command = f"--shape {','.join(map(str, shape))} --dtype bf16 --device 'NVIDIA H100 80GB HBM3' --compile"
    block = re.search(re.escape(command) + r"\n(.*?)```", text, re.S)
    assert block, f"no flash_explain output for {shape} in docs/architecture.md"
    assert (
        block.group(1).strip()
        == explain(shape, torch.bfloat16, "NVIDIA H100 80GB HBM3", compile=True).strip()
    )


def test_a_plan_takes_its_tuner_and_the_tuner_its_settings(device, generator) -> None:
    # Explicit objects instead of module globals: a plan given a tuner chooses through it (a config forced
    # there, not in the process's TUNER, runs), and a tuner given settings ignores the ones in force (tuning
    # off there: no timer is called although tuning is on in force; on a GPU, where a key has several
    # candidates).
    flash.clear_tuning_cache()
    q, k, v, _ = make_inputs((1, 64, 64, 32), torch.float32, device, generator)

    def no_timing(step):
        raise AssertionError("the tuner timed despite its own settings")

    tuner = flash.Tuner(
        timer=no_timing, warm_up=lambda s: None, can_time=True,
        settings=flash.FlashSettings(autotune=False),
    )  # fmt: skip
    with flash.configured(autotune=True), tuner.forcing("fwd", C(16, 16)):
        plan = flash.AttentionPlan(q, k, v, True, tuner=tuner)
        o, lse = plan.forward(q, k, v)
        plan.backward(q, k, v, o, torch.ones_like(o), lse)
    assert flash.launched(plan.case).fwd.config == C(16, 16) and not flash.TUNER.forced
    flash.clear_tuning_cache()


def test_an_expanded_grad_output_is_made_readable(device, generator) -> None:
    # out.sum().backward() hands the backward an expanded dO (every stride 0), eager and compiled alike,
    # which no descriptor reads: without a copy the TMA (and on Hopper the Gluon and one-pass) gates refuse
    # for the leaderboard's own call. Break tried: without the copy, dK/dV's TMA is refused here.
    flash.clear_tuning_cache()
    q, k, v, _ = make_inputs((2, 64, 64, 32), torch.float32, device, generator)
    with flash.forced("dkdv", C(16, 32, tma=True)):
        FlashAttentionTriton.apply(q, k, v, True).sum().backward()
    ran = flash.launched((2, 64, 64, 32, True, torch.float32)).dkdv
    assert ran.config.tma and not ran.refused, ran
    flash.clear_tuning_cache()


# -- the gates one by one (issue 57: one-line breaks of each passed every test before these) ---------------

LEADERBOARD = flash.Case(16, 16384, 16384, 64, True, torch.bfloat16)
GLUON = {  # a Gluon config per pass whose tiles every gate but the one under test lets through
    "fwd": C(128, 128, 4, 3, True, True, True),
    "dq": C(128, 64, 4, 3, True, True, True),
    "dkdv": C(64, 128, 4, 2, True, True, True),
}


def _replaced(layouts: Layouts, **tensors: torch.Tensor) -> Layouts:
    """``layouts`` with the facts of ``tensors`` (meta tensors, taken as aligned) in place of its own."""
    return Layouts(
        layouts.hopper, {**layouts.tensors, **{n: facts_of(t, aligned=True) for n, t in tensors.items()}}
    )


@pytest.mark.parametrize("on", [False, True], ids=["off", "on"])
def test_select_defaults_to_torchs_determinism_flag(on: bool, deterministic_flag) -> None:
    # The documented default: no ``deterministic`` argument means torch's flag, which rules out the
    # one-pass backward (dQ added up in no fixed order). The GPU test passes the flag explicitly, so only
    # this sees select ignore it. Break tried: select without its ``deterministic is None`` default -> "on"
    # runs the one-pass backward and records deterministic=None.
    one_pass = next(c for c in flash.gpu_candidates("dkdv", 64, torch.bfloat16) if c.one_pass)
    configs = {"dq": GLUON["dq"], "dkdv": one_pass}
    layouts = _hopper_facts(LEADERBOARD)
    deterministic_flag(on)
    chosen = flash.select(LEADERBOARD, layouts, configs)
    assert chosen.deterministic is on
    assert chosen.backward == ("split" if on else "one-pass")
    assert chosen == flash.select(LEADERBOARD, layouts, configs, deterministic=on)


@pytest.mark.parametrize("pass_", ["fwd", "dq", "dkdv"])
def test_a_refused_tma_gate_records_why(pass_: str) -> None:
    # Block pointers instead of descriptors where a row stride is not a multiple of 16 bytes (33 fp32
    # elements: 132 bytes): the pass runs without TMA and says so, never silently. Aligned strides keep
    # it (the control: the gate itself decides). Break tried: the TMA gate without its recorded reason.
    case = flash.Case(2, 64, 64, 32, True, torch.float32)
    t = lambda stride: torch.empty_strided(
        (1, 2, 64, 32), (2 * 64 * stride, 64 * stride, stride, 1), device="meta"
    )
    dense = flash.layouts_of(
        False, aligned=True, **{n: t(32) for n in ("q", "k", "v", "o", "do", "dq", "dk", "dv")}
    )
    asked = C(16, 16, tma=True)
    kept = flash.resolve(pass_, asked, case, dense)
    assert kept.config.tma and not kept.refused
    refused = flash.resolve(pass_, asked, case, _replaced(dense, k=t(33)))
    assert not refused.config.tma and refused.requested == asked
    assert len(refused.refused) == 1 and refused.refused[0].startswith("tma: ")
    assert refused.describe()["refused"] == list(refused.refused)


@pytest.mark.parametrize("pass_", ["fwd", "dq", "dkdv"])
@pytest.mark.parametrize("lse", ["bf16", "strided-fp32"])
def test_the_gluon_gate_takes_only_contiguous_float32_l(pass_: str, lse: str) -> None:
    # The Gluon kernels take L as a contiguous float32 vector (the dK/dV passes through a 1-D descriptor):
    # an L of another dtype, or a float32 one with gaps, must send the pass to Triton's kernel with the
    # reason. Each half of the check apart. Control: the contiguous float32 L of the same layouts keeps
    # Gluon. Breaks tried: the check dropped, and ``and`` for its ``or`` -> both fail here.
    n, bh = LEADERBOARD.n_q, LEADERBOARD.bh
    bad = {
        "bf16": torch.empty(1, bh, n, dtype=torch.bfloat16, device="meta"),
        "strided-fp32": torch.empty(1, bh, 2 * n, device="meta")[..., ::2],
    }[lse]
    good = _hopper_facts(LEADERBOARD)
    assert gluon_refusal(pass_, GLUON[pass_], LEADERBOARD, good) is None
    why = gluon_refusal(pass_, GLUON[pass_], LEADERBOARD, _replaced(good, lse=bad))
    assert why == "L not contiguous float32"
    ran = flash.resolve(pass_, GLUON[pass_], LEADERBOARD, _replaced(good, lse=bad))
    assert not ran.config.gluon and ran.refused[0] == f"gluon: {why}"
