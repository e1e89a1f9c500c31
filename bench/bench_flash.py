"""D11 (flash_benchmarking) and D12 (the leaderboard case of handout 1.3.3), timed with
``triton.testing.do_bench``.

D12 leaderboard (group key "leaderboard", runs first): exactly the handout's test, ``cases.LEADERBOARD_CASE``:
``q, k, v = torch.randn(3, *shape, bf16, requires_grad=True)`` (three views of one leaf, grads accumulate
as in the handout), ``flash = torch.compile(FlashAttentionTriton.apply)``, one rep = ``o = flash(q, k,
v, True); o.sum().backward()``. Side by side: SDPA flash and cuDNN backends on the same tensors as views
with a batch of 1, plain PyTorch eager and ``torch.compile``'d (static shapes). do_bench warm-up / rep
are 200 / 2000 ms (the handout's ``LEADERBOARD_CASE.warmup_ms`` / ``rep_ms`` give the same median; set
CS336_LEADERBOARD_WARMUP_MS and CS336_LEADERBOARD_REP_MS to them for the literal protocol).

D11 sweep (group key "flash_sweep"): batch 1, no head axis, causal; seq 128..65536 (powers of 2) x
d in {16, 32, 64, 128} x dtype in {bf16, fp32} x pass in {fwd, bwd, fwd_bwd} x impl in {pytorch,
pytorch_compiled, flash_triton, sdpa_flash, sdpa_cudnn, sdpa_efficient}.
- ``fwd`` is the training forward (inputs require grad, so autograd records and saves what backward
  needs); ``bwd`` is ``out.backward(dO, retain_graph=True)`` on one retained forward; ``fwd_bwd`` is
  both. do_bench resets q/k/v .grad between reps (``grad_to_none``) and flushes L2.
- ``extra_info["do_bench_ms"]`` (do_bench median, device time from CUDA events) is the authoritative
  number, with ``do_bench_p20_ms`` / ``do_bench_p80_ms`` / ``do_bench_min_ms`` / ``do_bench_reps``,
  ``flops`` and ``tflops`` (forward 4·seq²·d·batch·heads, halved for causal; bwd 2.5x, fwd_bwd 3.5x).
  do_bench warm-up / rep default to 10 / 50 ms (CS336_DO_BENCH_WARMUP_MS, CS336_DO_BENCH_REP_MS).
- On CUDA, ``launch_ms`` is the host's time to issue one call (``launch_time``) and ``host_bound`` says
  it is at least ``do_bench_ms``: then the events timed the host's issue rate, which moves with the
  host's load (rows.contention judges such rows by it); fwd and fwd_bwd also carry ``graph_ms``, the
  device time alone (CUDA-graph replay, as in attention shapes below).
- pytest-benchmark's own statistics come from 3-20 further host-timed, synchronized reps of the same
  pass (about 100 ms of work; ``run_benchmark``), so ``--benchmark-compare`` and regression gates have
  data; they include launch + synchronize overhead (~tens of us) that do_bench's events do not.
- Rows that did not run say why: ``status`` "unsupported" (an SDPA backend this build/GPU/dtype does
  not have, e.g. flash and cuDNN have no fp32: probed once per backend/dtype/d), "skipped" (plain
  PyTorch above CS336_NAIVE_MAX_SEQ, default 65536 = no cap: at batch 1 naive attention at seq 65536
  needs about 52 GiB in fp32 and fits an 80 GB card), or "oom" (``oom=True``).
- ``pytorch_compiled`` compiles once per shape with ``dynamic=False``; cases are ordered so the three
  passes of one shape and impl run back to back and share the compile.

Attention shapes (group key "attention_shapes", issue 14): the shapes people train with, as (batch,
heads, seq_q, seq_k, d, causal) in bf16 (``SHAPES``: the issue's grid, then ``BREADTH_SHAPES``, rows
with ``shape_set`` "breadth") x impl in {sdpa_flash, sdpa_cudnn, sdpa_efficient, flash_triton} x pass in
{fwd, bwd, fwd_bwd}, 4-D inputs. A shape's first case
measures all of its selected impls and passes at once:
- each impl's output and dQ on a sample of query rows (first and last 128 of the first and last
  head) are checked against float32 math on those rows (cheap at any length); a wrong result fails
  the case;
- all (impl, pass) steps are timed in ``CS336_SHAPE_ROUNDS`` (default 5) interleaved rounds of
  do_bench (10 ms of reps each, order rotated per round): on a host whose speed drifts, sequential
  timing compared one host state with another (short, host-bound rows swung 2x between runs).
  ``do_bench_ms`` is the median of the round medians, ``do_bench_round_ms`` the round medians;
- fwd and fwd_bwd are also replayed from a CUDA graph (``graph_ms``, ``do_bench_cudagraph``: no host
  work between calls, L2 not flushed): the device time alone, what a CUDA-graphed step pays.
Our rows carry ``ratio_to_<backend>`` (median of the per-round ratios: host drift between rounds
cancels), ``ratio_to_best_sdpa``, ``graph_ratio_to_<backend>``, the configs as they ran and ``launched`` (per
pass: the kernel, its config, and any gate that refused the requested one; also on the leaderboard and
sweep rows), where each config came
from (``config_source``: "tuned", or "table" for the tuning table shipped for this GPU model, which
``CS336_FLASH_TUNE_TABLE=0`` turns off) and ``tune_seconds_so_far`` (a cold run's last shape holds the
whole grid's tuning cost). Backends that
refuse a case are ``unsupported`` rows with torch's reason; an impl that cannot be captured in a graph
has ``graph_error``. pytest-benchmark's own statistics are 3 synchronized host-timed passes per case.

On a CPU-only machine: the D12 cases and all D11 cases but seq 128, d 16 are marked ``gpu`` and skip
with a reason; that CPU variant runs plain PyTorch and the SDPA backends (both dtypes) and compiled
PyTorch (fp32) with a host clock (``timer="host"``). flash_triton is GPU-only (the Triton interpreter
is far too slow for timing).

Selection, e.g. the writeup subset in one command (estimated 7-9 min on one H100; the D12 cases have no
d parameter, so ``--only d=...`` keeps them)::

    pytest bench/bench_flash.py --only d=64,128
    pytest bench/bench_flash.py -k leaderboard
    pytest bench/bench_flash.py --only impl=flash_triton,sdpa_flash --only dtype=bf16 --only pass=fwd_bwd
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from cs336_systems.grading.judge.pytest_plugin import ROOTS
from cs336_systems.grading.shared.cases import LEADERBOARD_CASE
from cs336_systems.harness.adapters import IMPL, TRITON_HOOK, adapters_param
from cs336_systems.harness.attention import (
    ATTENTION_SHAPES,
    BREADTH_SHAPES,
    IMPLS,
    PASSES,
    SDPA_BACKENDS,
    PassStep,
    as_dtype,
    impl_context,
    is_unsupported_error,
    load_flash_triton,
    make_grad,
    make_qkv,
    resolve_impl,
    sdpa_unsupported_reason,
)
from cs336_systems.harness.environment import environment_info
from cs336_systems.harness.record import log_case, record_not_run, record_oom, record_times, run_benchmark
from cs336_systems.harness.settings import settings
from cs336_systems.kernels import flash
from cs336_systems.profiling.flops import attention_flops, tflops
from cs336_systems.profiling.memory import free_device_memory
from cs336_systems.profiling.timing import (
    device_time,
    graph_time,
    interleaved_device_time,
    is_oom,
    launch_time,
    paired_ratio,
    rounds_for,
)
from cs336_systems.rows.contention import host_bound
from cs336_systems.rows.schema import tag

D11_SEQS = tuple(2**i for i in range(7, 17))  # 128 .. 65536
D11_DS = (16, 32, 64, 128)
D11_DTYPES = ("bf16", "fp32")
D11_BATCH = 1
NAIVE_IMPLS = ("pytorch", "pytorch_compiled")
CPU_SEQ, CPU_D = 128, 16

# (case, impl) pairs whose output was checked against a reference in this run (once, before timing).
_CHECKED: set[tuple] = set()

LB_HEADS, LB_SEQ, LB_D = LEADERBOARD_CASE.shape
LB_IMPLS = ("flash_triton", "sdpa_flash", "sdpa_cudnn", "pytorch", "pytorch_compiled")
# SPEC.md: one H200, torch 2.11, triton 3.6, do_bench median of the same case. Context, not a result.
LB_REFERENCE_MS_H200 = {"sdpa_flash": 7.05, "sdpa_cudnn": 4.40, "pytorch": 127.0, "pytorch_compiled": 39.3}


# ---------------------------------------------------------------------------------- D12 leaderboard


def _sdpa_heads_layout(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, is_causal: bool) -> torch.Tensor:
    # (16, seq, d) viewed as (1, 16, seq, d): batch 1, 16 heads, the layout SDPA users have.
    return F.scaled_dot_product_attention(q[None], k[None], v[None], is_causal=is_causal)[0]


def _leaderboard_fn(impl: str) -> Any:
    if impl == "flash_triton":
        torch._dynamo.reset()
        return torch.compile(load_flash_triton().apply)  # exactly the handout's call
    if impl in SDPA_BACKENDS:
        return _sdpa_heads_layout
    return resolve_impl(impl, shape_key=("leaderboard", LB_HEADS, LB_SEQ, LB_D))


@pytest.mark.gpu
@pytest.mark.parametrize("impl", [*LB_IMPLS, adapters_param(hooks=(TRITON_HOOK,))])
def test_leaderboard(benchmark, device: torch.device, pytestconfig: pytest.Config, impl: str) -> None:
    tag(benchmark, "leaderboard")
    info: dict[str, Any] = dict(
        deliverable="D12",
        impl=impl,
        heads=LB_HEADS,
        seq=LB_SEQ,
        d=LB_D,
        dtype="bf16",
        causal=True,
        pass_="fwd_bwd",
        flops=attention_flops(1, LB_SEQ, LB_D, heads=LB_HEADS, causal=True, pass_="fwd_bwd"),
        reference_ms_h200=LB_REFERENCE_MS_H200.get(impl),
        **environment_info(device),
    )
    if impl in SDPA_BACKENDS:
        reason = sdpa_unsupported_reason(impl, torch.bfloat16, LB_D, device.type)
        if reason is not None:
            record_not_run_and_log(benchmark, "unsupported", reason, **info)
            return
    free_device_memory()
    if impl == IMPL:  # the student's kernel in a process of its own: the parent's clock and the course's
        from cs336_systems.grading.repo.leaderboard.row import row

        result = row(pytestconfig.stash[ROOTS], None, keep_times=True)
        times = result.pop("course_times_ms", None)
        info.update(result)
        if result.get("error") or not times:
            record_not_run_and_log(
                benchmark, "error", result.get("error") or result["unranked_because"], **info
            )
            return
        record_times(benchmark, times, tflops=tflops(info["flops"], result["course_ms"]), **info)
        log_case(benchmark)
        return
    torch.manual_seed(0)
    qkv = torch.randn(3, LB_HEADS, LB_SEQ, LB_D, device=device, dtype=torch.bfloat16, requires_grad=True)
    q, k, v = qkv
    attn = _leaderboard_fn(impl)

    def flash_forward_backward() -> None:
        o = attn(q, k, v, True)
        loss = o.sum()
        loss.backward()

    try:
        with impl_context(impl):
            timing = device_time(
                flash_forward_backward,
                device,
                warmup_ms=settings().leaderboard_warmup_ms,
                rep_ms=settings().leaderboard_rep_ms,
            )
            info.update(timing, tflops=tflops(info["flops"], timing["do_bench_ms"]))
            if impl == "flash_triton":  # what ran, per pass
                info.update(flash.launched_info((LB_HEADS, LB_SEQ, LB_SEQ, LB_D, True, torch.bfloat16)))
            times = run_benchmark(
                benchmark,
                flash_forward_backward,
                device,
                warmup=0,
                rounds=rounds_for(timing["do_bench_ms"], budget_ms=200, lo=5),
                **info,
            )
        status = "ok" if times is not None else "oom"
    except Exception as exc:
        if not is_oom(exc):
            raise
        record_oom(benchmark, **info)
        status = "oom"
    finally:
        qkv = q = k = v = None
        free_device_memory()
    benchmark.extra_info["status"] = status
    log_case(benchmark)


# ------------------------------------------------------------------------------------------ D11 sweep


def _keep_graph_compatible(impl: str) -> contextlib.AbstractContextManager:
    """The ``bwd`` pass calls ``backward(retain_graph=True)`` on one forward; a compiled backward with
    donated buffers refuses that (torch >= 2.13), so the compiled impl is built without them (the
    setting counts when the shape first compiles, which may be any pass)."""
    if impl in NAIVE_IMPLS[1:]:
        return torch._functorch.config.patch(donated_buffer=False)
    return contextlib.nullcontext()


def _sweep_cases() -> list:
    # Order: one shape at a time, its impls, their passes innermost, so a per-shape compile is shared.
    cases = []
    for dtype in D11_DTYPES:
        for d in D11_DS:
            for seq in D11_SEQS:
                for impl in IMPLS:
                    cpu_ok = (seq, d) == (CPU_SEQ, CPU_D) and (
                        impl == "pytorch"
                        or impl in SDPA_BACKENDS
                        or (impl, dtype) == ("pytorch_compiled", "fp32")
                    )
                    marks = () if cpu_ok else (pytest.mark.gpu,)
                    for pass_ in PASSES:
                        case_id = f"{impl}-{dtype}-d{d}-seq{seq}-{pass_}"
                        cases.append(pytest.param(impl, dtype, d, seq, pass_, marks=marks, id=case_id))
    return cases


def _not_run(impl: str, dtype: str, d: int, seq: int, device: torch.device) -> tuple[str, str] | None:
    """(status, reason) for a case that will not be timed, else None."""
    cap = settings().naive_max_seq
    if impl in NAIVE_IMPLS and seq > cap:
        gib = seq * seq * as_dtype(dtype).itemsize / 2**30
        return "skipped", (
            f"plain PyTorch capped at seq {cap} (CS336_NAIVE_MAX_SEQ): it materializes seq x seq scores "
            f"({gib:.0f} GiB per copy at {dtype}) several times"
        )
    if impl in SDPA_BACKENDS:
        reason = sdpa_unsupported_reason(impl, as_dtype(dtype), d, device.type)
        if reason is not None:
            return "unsupported", reason
    return None


@pytest.mark.parametrize(("impl", "dtype", "d", "seq", "pass_"), _sweep_cases())
def test_flash_sweep(
    benchmark, device: torch.device, impl: str, dtype: str, d: int, seq: int, pass_: str
) -> None:
    tag(benchmark, "flash_sweep")
    info: dict[str, Any] = dict(
        deliverable="D11",
        impl=impl,
        dtype=dtype,
        d=d,
        seq=seq,
        pass_=pass_,
        batch=D11_BATCH,
        heads=1,
        causal=True,
        flops=attention_flops(D11_BATCH, seq, d, causal=True, pass_=pass_),
        **environment_info(device),
    )
    skip = _not_run(impl, dtype, d, seq, device)
    if skip is not None:
        record_not_run_and_log(benchmark, *skip, **info)
        return
    step: PassStep | None = None
    status = "error"
    try:
        with impl_context(impl), _keep_graph_compatible(impl):
            fn = resolve_impl(impl, shape_key=(dtype, d, seq))
            if (impl, dtype, d, seq) not in _CHECKED:
                shape = (D11_BATCH, 1, seq, seq, d, True)
                info["check_rel_err"] = check_rows(fn, shape, device, as_dtype(dtype), three_d=True)
                _CHECKED.add((impl, dtype, d, seq))
            q, k, v = make_qkv(D11_BATCH, seq, d, dtype, device)
            step = PassStep(fn, q, k, v, pass_)
            timing = device_time(
                step,
                device,
                warmup_ms=settings().do_bench_warmup_ms,
                rep_ms=settings().do_bench_rep_ms,
                grad_to_none=step.grads,
            )
            info.update(timing, tflops=tflops(info["flops"], timing["do_bench_ms"]))
            if device.type == "cuda":  # did do_bench's events time the device, or the host's issue rate?
                reps = rounds_for(timing["do_bench_ms"])
                info["launch_ms"] = launch_time(step, device, reps=reps, grad_to_none=step.grads)
                info["host_bound"] = host_bound(info)
                info.update(_graph_ms(impl, step) if pass_ in GRAPHED_PASSES else {})
            if impl == "flash_triton":  # what ran, per pass
                info.update(flash.launched_info((D11_BATCH, seq, seq, d, True, as_dtype(dtype))))
            times = run_benchmark(
                benchmark,
                step,
                device,
                warmup=0,
                rounds=rounds_for(timing["do_bench_ms"]),
                setup=step.zero_grads,
                **info,
            )
        status = "ok" if times is not None else "oom"
    except Exception as exc:
        status = _expected_failure(benchmark, exc, impl, info)
        if status == "unsupported":
            return
    finally:
        if step is not None:
            step.close()
        step = q = k = v = None
        # Inputs and graphs are freed by refcount; big or failed cases also hand cached blocks back.
        if status != "ok" or seq >= 8192:
            free_device_memory(device, collect=status != "ok")
    benchmark.extra_info["status"] = status
    log_case(benchmark)


def record_not_run_and_log(benchmark, status: str, reason: str, **info: Any) -> None:
    record_not_run(benchmark, status, reason, **info)
    log_case(benchmark)


def _failure_kind(exc: Exception, impl: str) -> str | None:
    """ "oom", "unsupported" (an SDPA backend's refusal), or None for anything else (a bug)."""
    if is_oom(exc):
        return "oom"
    if impl in SDPA_BACKENDS and is_unsupported_error(exc):
        return "unsupported"
    return None


def _expected_failure(benchmark: Any, exc: Exception, impl: str, info: dict[str, Any]) -> str:
    """Record an out-of-memory ("oom") or an SDPA backend's refusal ("unsupported") as a row and name
    it; anything else is a bug and propagates."""
    kind = _failure_kind(exc, impl)
    if kind == "oom":
        record_oom(benchmark, **info)
    elif kind == "unsupported":
        record_not_run_and_log(benchmark, "unsupported", str(exc).splitlines()[0], **info)
    else:
        raise exc
    return kind


# ------------------------------------------------------------------------------- attention shapes

SHAPES = ATTENTION_SHAPES + BREADTH_SHAPES
# Runs everywhere (a CPU-only machine times the SDPA backends it has and our kernels under Triton's
# interpreter, host clock): the group's code path, not a figure for the writeup.
CPU_SHAPE = (1, 2, 64, 64, 16, True)
SHAPE_IMPLS = (*SDPA_BACKENDS, "flash_triton")
GRAPHED_PASSES = ("fwd", "fwd_bwd")  # a retained forward (the bwd pass) was recorded outside any capture
CHECK_ROWS = 128
ROUND_WARMUP_MS, ROUND_REP_MS, GRAPH_REP_MS = 5, 10, 10


def _shape_id(shape: tuple) -> str:
    b, h, nq, nk, d, causal = shape
    return f"b{b}-h{h}-q{nq}-k{nk}-d{d}-{'causal' if causal else 'full'}"


def _shape_inputs(shape: tuple, device: torch.device, seed: int = 0, dtype=torch.bfloat16, three_d=False):
    """q, k, v of ``shape``: (batch, heads, seq, d), or (batch, seq, d) with ``three_d`` (heads 1)."""
    b, h, nq, nk, d, _ = shape
    gen = torch.Generator(device=device).manual_seed(seed)
    dims = lambda n: (b, n, d) if three_d else (b, h, n, d)
    draw = lambda n: torch.randn(*dims(n), device=device, dtype=dtype, generator=gen)
    return tuple(t.requires_grad_() for t in (draw(nq), draw(nk), draw(nk)))


def check_rows(
    fn, shape: tuple, device: torch.device, dtype=torch.bfloat16, three_d=False
) -> dict[str, float]:
    """Relative errors of O and dQ on sampled query rows against float32 math on those rows alone (the
    rows' scores against all keys: cheap at any length). Fresh random inputs; raises if over 2e-2
    (bf16 operands; fp32 ones run as tf32 in the fused kernels)."""
    b, h, nq, nk, d, causal = shape
    seed = int(torch.randint(1 << 30, ()).item())
    q, k, v = _shape_inputs(shape, device, seed=seed, dtype=dtype, three_d=three_d)
    # Explicit generators throughout: a failed CUDA-graph capture elsewhere leaves the default CUDA
    # generator unusable ("Offset increment outside graph capture"), and must not fail later checks.
    do = make_grad(q, seed=seed + 1)
    o = fn(q, k, v, causal)
    o.backward(do)
    rows = torch.cat([torch.arange(min(CHECK_ROWS, nq)), torch.arange(max(nq - CHECK_ROWS, 0), nq)]).unique()
    rows = rows.to(device)
    errors: dict[str, float] = {}
    for head in {(0,) if three_d else (0, 0), (b - 1,) if three_d else (b - 1, h - 1)}:
        q_rows = q.detach()[head][rows].float().requires_grad_()
        kf, vf = k.detach()[head].float(), v.detach()[head].float()
        s = q_rows @ kf.T / d**0.5
        if causal:
            s = s + torch.where(torch.arange(nk, device=device)[None, :] > rows[:, None], -1e6, 0.0)
        o_ref = torch.softmax(s, dim=-1) @ vf
        o_ref.backward(do[head][rows].float())
        for name, got, ref in (("O", o.detach()[head][rows], o_ref), ("dQ", q.grad[head][rows], q_rows.grad)):
            err = ((got.float() - ref).norm() / ref.norm()).item()
            errors[name] = max(errors.get(name, 0.0), err if err == err else float("inf"))
    bad = {n: e for n, e in errors.items() if not e < 2e-2}
    assert not bad, f"{_shape_id(shape)}: relative errors over 2e-2 on sampled rows: {bad}"
    return errors


@dataclass
class ShapeResult:
    """One impl's results at one shape: per pass a timing dict (``interleaved_device_time`` plus
    ``graph_ms``), or why it has none (``status`` "unsupported" / "oom" / "error" with ``error``)."""

    status: str = "ok"
    reason: str = ""
    error: Exception | None = None
    check_rel_err: dict[str, float] = field(default_factory=dict)
    passes: dict[str, dict[str, Any]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


# The shape measured last (its results serve the shape's remaining cases); one shape at a time.
_SHAPE_RESULTS: dict[tuple, dict[str, ShapeResult]] = {}


def _selected_impls(session: pytest.Session, shape: tuple) -> list[str]:
    """The impls this session runs at ``shape`` (after --only / -k), in SHAPE_IMPLS order."""
    chosen = {
        item.callspec.params["impl"]
        for item in session.items
        if getattr(item, "originalname", "") == "test_attention_shapes"
        and item.callspec.params["shape"] == shape
    }
    return [impl for impl in SHAPE_IMPLS if impl in chosen]


def _prepare(impl: str, shape: tuple, device: torch.device, q, k, v) -> tuple[dict[str, PassStep], dict]:
    """Check ``impl`` at ``shape`` (a wrong result fails the case) and build its three passes on the
    shared inputs (do_bench resets their grads before every rep). Returns (steps, relative errors)."""
    fn = resolve_impl(impl, shape_key=shape)
    with impl_context(impl):
        check = check_rows(fn, shape, device)
        steps = {pass_: PassStep(fn, q, k, v, pass_, is_causal=shape[-1]) for pass_ in PASSES}
    return steps, check


def _graph_ms(impl: str, step: PassStep) -> dict[str, Any]:
    # Fresh leaves: the bwd pass's retained graph holds AccumulateGrad nodes of the shared inputs, made
    # on the default stream, and a backward into them from the capture stream breaks the capture.
    fresh = (x.detach().clone().requires_grad_() for x in (step.q, step.k, step.v))
    graphed = PassStep(step.fn, *fresh, step.pass_, is_causal=step.is_causal)
    try:
        with impl_context(impl):
            return {"graph_ms": graph_time(graphed, rep_ms=GRAPH_REP_MS, grad_to_none=graphed.grads)}
    except Exception as exc:  # an impl that cannot be captured is a finding, not the end of the run
        if is_oom(exc):
            return {"graph_error": "out of memory"}
        return {"graph_error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
    finally:
        graphed.close()


def _build_steps(
    shape: tuple, results: dict[str, ShapeResult], device: torch.device, q, k, v
) -> dict[tuple[str, str], PassStep]:
    """The (impl, pass) steps of every impl that checks out at ``shape``; the others get their status."""
    steps: dict[tuple[str, str], PassStep] = {}
    b, h, nq, nk, d, causal = shape
    for impl, r in results.items():
        reason = (
            sdpa_unsupported_reason(impl, torch.bfloat16, d, device.type) if impl in SDPA_BACKENDS else None
        )
        if reason is not None:
            r.status, r.reason = "unsupported", reason
            continue
        try:
            impl_steps, r.check_rel_err = _prepare(impl, shape, device, q, k, v)
        except Exception as exc:
            _failed(r, impl, exc)
            continue
        steps.update({(impl, pass_): step for pass_, step in impl_steps.items()})
        if impl == "flash_triton":
            case = (b * h, nq, nk, d, causal, torch.bfloat16)
            r.extra["configs"] = flash.chosen_configs(case)  # as they ran (no dQ under the one-pass backward)
            r.extra.update(flash.launched_info(case))  # kernels and configs per pass, and gates that refused
            r.extra["tuning_ms"] = flash.candidate_timings(case)  # empty for a shipped table's keys
            r.extra["config_source"] = flash.config_sources(case)
            # Seconds spent tuning (compiles included) in this process so far: the last row of a cold
            # run of the group is the whole grid's tuning cost.
            r.extra["tune_seconds_so_far"] = flash.tuning_report()["tune_seconds"]
    return steps


def _measure_shape(shape: tuple, impls: list[str], device: torch.device) -> dict[str, ShapeResult]:
    """Every impl's passes at ``shape``, timed in interleaved rounds (``settings().shape_rounds``), then
    each fwd and fwd_bwd replayed from a CUDA graph. Failures are per impl (see ShapeResult)."""
    results = {impl: ShapeResult() for impl in impls}
    q, k, v = _shape_inputs(shape, device)
    steps = _build_steps(shape, results, device, q, k, v)
    try:
        timings = interleaved_device_time(
            steps,
            device,
            rounds=settings().shape_rounds,
            warmup_ms=ROUND_WARMUP_MS,
            rep_ms=ROUND_REP_MS,
            grad_to_none={key: step.grads for key, step in steps.items()},
            contexts={key: functools.partial(impl_context, key[0]) for key in steps},
        )
        for (impl, pass_), timing in timings.items():
            if pass_ in GRAPHED_PASSES and device.type == "cuda":
                timing.update(_graph_ms(impl, steps[impl, pass_]))
            results[impl].passes[pass_] = timing
    except Exception as exc:  # e.g. out of memory with every impl's inputs alive: all measured impls fail
        for impl in {impl for impl, _ in steps}:
            _failed(results[impl], impl, exc)
    finally:
        for step in steps.values():
            step.close()
        steps.clear()
        q = k = v = None
        free_device_memory(device)
    return results


def _failed(r: ShapeResult, impl: str, exc: Exception) -> None:
    r.status = _failure_kind(exc, impl) or "error"
    if r.status == "error":
        r.error = exc
    elif r.status == "unsupported":
        r.reason = str(exc).splitlines()[0]


def _ratios(timing: dict[str, Any], pass_: str, results: dict[str, ShapeResult]) -> dict[str, Any]:
    """Ours against each SDPA backend of the same run: ``ratio_to_<backend>`` pairs the interleaved
    rounds (median of per-round ratios), ``graph_ratio_to_<backend>`` compares CUDA-graph replays."""
    out: dict[str, Any] = {}
    ref = {
        name: r.passes[pass_] for name, r in results.items() if name in SDPA_BACKENDS and pass_ in r.passes
    }
    for name, other in ref.items():
        out[f"ratio_to_{name}"] = paired_ratio(timing["do_bench_round_ms"], other["do_bench_round_ms"])
        if "graph_ms" in timing and "graph_ms" in other:
            out[f"graph_ratio_to_{name}"] = timing["graph_ms"] / other["graph_ms"]
    if ref:
        best = min(ref, key=lambda name: ref[name]["do_bench_ms"])
        out.update(best_sdpa=best, ratio_to_best_sdpa=out[f"ratio_to_{best}"])
    return out


def _shape_cases() -> list:
    cases = [
        pytest.param(CPU_SHAPE, impl, pass_, id=f"{_shape_id(CPU_SHAPE)}-{impl}-{pass_}")
        for impl in SHAPE_IMPLS
        for pass_ in PASSES
    ]
    cases += [
        pytest.param(shape, impl, pass_, marks=pytest.mark.gpu, id=f"{_shape_id(shape)}-{impl}-{pass_}")
        for shape in SHAPES
        for impl in SHAPE_IMPLS
        for pass_ in PASSES
    ]
    return cases


@pytest.mark.parametrize(("shape", "impl", "pass_"), _shape_cases())
def test_attention_shapes(
    benchmark, request, device: torch.device, shape: tuple, impl: str, pass_: str
) -> None:
    tag(benchmark, "attention_shapes")
    b, h, nq, nk, d, causal = shape
    flops = attention_flops(b, nq, d, heads=h, causal=causal, pass_=pass_, n_keys=nk)
    info: dict[str, Any] = dict(
        impl=impl, shape=_shape_id(shape), shape_set="breadth" if shape in BREADTH_SHAPES else "grid",
        batch=b, heads=h, seq_q=nq, seq_k=nk, d=d, causal=causal,
        dtype="bf16", pass_=pass_, flops=flops, **environment_info(device),
    )  # fmt: skip
    if shape not in _SHAPE_RESULTS:  # the shape's first case measures all of its selected impls
        _SHAPE_RESULTS.clear()
        _SHAPE_RESULTS[shape] = _measure_shape(shape, _selected_impls(request.session, shape), device)
    results = _SHAPE_RESULTS[shape]
    r = results[impl]
    if r.status == "unsupported":
        record_not_run_and_log(benchmark, "unsupported", r.reason, **info)
        return
    if r.status == "oom":
        record_oom(benchmark, **info, status="oom")
        log_case(benchmark)
        return
    if r.error is not None:
        raise r.error
    timing = r.passes[pass_]
    info.update(timing)
    info.update(r.extra, check_rel_err=r.check_rel_err, tflops=tflops(flops, timing["do_bench_ms"]))
    if impl == "flash_triton":
        info.update(_ratios(timing, pass_, results))
    # pytest-benchmark's own rounds (for --benchmark-compare): 3 synchronized host-timed passes.
    step: PassStep | None = None
    try:
        with impl_context(impl):
            fn = resolve_impl(impl, shape_key=shape)
            step = PassStep(fn, *_shape_inputs(shape, device), pass_, is_causal=causal)
            times = run_benchmark(benchmark, step, device, warmup=0, rounds=3, setup=step.zero_grads, **info)
        status = "ok" if times is not None else "oom"
    except Exception as exc:
        status = _expected_failure(benchmark, exc, impl, info)
        if status == "unsupported":
            return
    finally:
        if step is not None:
            step.close()
        step = None
        free_device_memory(device)
    benchmark.extra_info["status"] = status
    log_case(benchmark)
