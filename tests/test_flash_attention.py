"""D9/D10/D12: FlashAttention-2 (plain PyTorch and Triton) against a float64 reference.

Relative errors ‖x − ref‖/‖ref‖ of O, L, dQ, dK, dV; causal and not; fp32, bf16 (and fp16); ragged
lengths and n_queries != n_keys; head dims 16..128 (48 is padded to 64 inside the kernels). On a
CPU-only machine the root conftest sets TRITON_INTERPRET=1 before import, so the Triton kernels run
under the interpreter with tiny shapes; on a GPU the same tests run compiled, plus larger shapes, every
tuning candidate, and torch.compile(apply) on the leaderboard case.
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from triton.tools.tensor_descriptor import TensorDescriptor

from cs336_systems.attention import flash_pytorch, flash_triton, get_attention_fn
from cs336_systems.attention.flash_pytorch import FlashAttentionPytorch
from cs336_systems.attention.flash_triton import FlashAttentionTriton, FlashAttentionTritonCompiledBackward
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash.tune_table import TuneTable

from .helpers.attention import (
    DTYPES,
    check_against_reference,
    make_inputs,
    reference_attention,
    rel_err,
    tolerance,
)

# The Triton interpreter (numpy) warns about a deprecated scalar conversion on every launch.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

IMPLS = {"pytorch": FlashAttentionPytorch, "triton": FlashAttentionTriton}


# -- the interpreter really runs the kernels on CPU ------------------------------------------------------


def test_kernels_compiled_or_interpreted(device: torch.device) -> None:
    names = {type(flash.flash_fwd_kernel).__name__, type(flash.flash_bwd_dkdv_kernel).__name__}
    if device.type == "cpu":
        assert flash.INTERPRET, "TRITON_INTERPRET=1 must be set before import on a CPU-only machine"
        assert names == {"InterpretedFunction"}
    else:
        assert names == {"JITFunction"}


# -- correctness against float64 (small shapes: these run under the interpreter on CPU) ------------------

SMALL_SHAPES = {  # (batch, n_queries, n_keys, d)
    "ragged-q100-k72-d32": (2, 100, 72, 32),
    "ragged-q40-k100-d16": (1, 40, 100, 16),
    "even-q64-k64-d64": (2, 64, 64, 64),
    "q48-k48-d128": (1, 48, 48, 128),
    "odd-q33-k47-d48": (1, 33, 47, 48),
}


@pytest.mark.parametrize("shape", SMALL_SHAPES.values(), ids=SMALL_SHAPES.keys())
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("impl", IMPLS)
def test_matches_reference(impl, is_causal, dtype, shape, device, generator) -> None:
    dtype = DTYPES[dtype]
    q, k, v, do = make_inputs(shape, dtype, device, generator)
    check_against_reference(IMPLS[impl].apply, q, k, v, do, is_causal, tolerance(dtype, device))


@pytest.mark.parametrize("impl", IMPLS)
def test_fp16(impl, device, generator) -> None:
    q, k, v, do = make_inputs((2, 70, 50, 32), torch.float16, device, generator)
    check_against_reference(IMPLS[impl].apply, q, k, v, do, True, tolerance(torch.float16, device))


@pytest.mark.parametrize("impl", IMPLS)
def test_saves_exactly_one_logsumexp(impl, device, generator) -> None:
    # The grading contract: among the saved tensors exactly one has shape (batch, n_queries), float32.
    q, k, v, _ = make_inputs((4, 64, 64, 16), torch.float32, device, generator)
    o = IMPLS[impl].apply(q, k, v)
    saved = o.grad_fn.saved_tensors
    lse = [t for t in saved if t.shape == (4, 64)]
    assert len(lse) == 1 and lse[0].dtype == torch.float32
    assert len(saved) == 5  # L, Q, K, V, O


@pytest.mark.parametrize("impl", IMPLS)
def test_four_dim_and_noncontiguous_inputs(impl, device, generator) -> None:
    batch, heads, n, d = 2, 3, 40, 32
    draw = lambda: torch.randn(batch, heads, d, n, generator=generator).to(device).transpose(-2, -1)
    q, k, v = (draw().requires_grad_() for _ in range(3))  # (batch, heads, seq, d), not contiguous
    assert not q.is_contiguous()
    do = torch.randn(batch, heads, n, d, generator=generator).to(device)
    check_against_reference(IMPLS[impl].apply, q, k, v, do, True, tolerance(torch.float32, device))
    assert q.grad.shape == (batch, heads, n, d)


def test_model_layout_without_copies(device, generator) -> None:
    # The model's call: q, k contiguous (batch, heads, seq, d), v a permuted view of the fused QKV
    # projection. The kernels read every stride as given, and O comes back in (batch, seq, heads, d)
    # memory order, so the model's out.transpose(1, 2).reshape(batch, seq, heads * d) is a view.
    batch, heads, n, d = 2, 3, 40, 32
    qkv = torch.randn(batch, n, 3, heads, d, generator=generator).to(device).permute(2, 0, 3, 1, 4)
    q, k = (t.contiguous().requires_grad_() for t in qkv[:2])
    v = qkv[2].detach().requires_grad_()  # a leaf that keeps the permuted strides
    assert not v.is_contiguous() and v.stride(-2) == 3 * heads * d
    do = torch.randn(batch, heads, n, d, generator=generator).to(device)
    check_against_reference(FlashAttentionTriton.apply, q, k, v, do, True, tolerance(torch.float32, device))
    out = FlashAttentionTriton.apply(q.detach(), k.detach(), v.detach(), True)
    assert out.transpose(1, 2).is_contiguous(), out.stride()


# -- per-signature plans: later calls of a signature launch what its first call compiled ------------------


def test_plans_by_call_signature(device, generator) -> None:
    # A plan fixes strides, dtypes, alignment and causality: a call that differs in any of them gets a plan
    # of its own, and every call is right on its own data.
    flash.clear_plans()
    shape = (2, 3, 40, 32)
    tol = tolerance(torch.float32, device)
    leaf = lambda t: t.detach().requires_grad_()
    draw = lambda *s: torch.randn(*s, generator=generator).to(device)

    def check(q, k, v, do, planned: int, is_causal: bool = True) -> None:
        check_against_reference(FlashAttentionTriton.apply, q, k, v, do, is_causal, tol)
        assert len(flash.PLANS) == planned

    check(*(leaf(draw(*shape)) for _ in range(3)), draw(*shape), planned=1)
    check(*(leaf(draw(*shape)) for _ in range(3)), draw(*shape), planned=1)  # reused, on new data
    check(*(leaf(draw(*shape)) for _ in range(3)), draw(*shape), planned=2, is_causal=False)
    v_t = leaf(draw(2, 3, 32, 40).transpose(-2, -1))  # same shape, other strides
    check(leaf(draw(*shape)), leaf(draw(*shape)), v_t, draw(*shape), planned=3)
    # q 4 bytes past a 16-byte boundary: the kernels compiled for aligned pointers must not see it.
    q_off = leaf(draw(2 * 3 * 40 * 32 + 1)[1:].view(shape))
    assert q_off.data_ptr() % 16
    check(q_off, leaf(draw(*shape)), leaf(draw(*shape)), draw(*shape), planned=4)
    # dO with stride 0 (what o.sum().backward() hands down) reuses the forward's plan.
    check(*(leaf(draw(*shape)) for _ in range(3)), torch.ones((), device=device).expand(shape), planned=4)
    # The same data as 3-D (batch * heads, seq, d) input.
    check(*(leaf(draw(6, 40, 32)) for _ in range(3)), draw(6, 40, 32), planned=5)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        x = draw(*shape)
        FlashAttentionTriton.apply(x, x, x, 1)  # equal to True as a dict key


@pytest.mark.gpu(2)
def test_inputs_off_the_current_device_are_refused(generator) -> None:
    # Triton launches on the current device; another device's pointers there would fault the kernel.
    x = torch.randn(1, 2, 64, 32, generator=generator).to("cuda:1")
    with torch.cuda.device(0), pytest.raises(ValueError, match="current CUDA device is cuda:0"):
        FlashAttentionTriton.apply(x, x, x, True)
    with torch.cuda.device(1):
        assert torch.isfinite(FlashAttentionTriton.apply(x, x, x, True)).all()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("bad", ["no", 1, None])
def test_is_causal_must_be_bool(impl, bad, device) -> None:
    x = torch.randn(1, 16, 16, device=device)
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        IMPLS[impl].apply(x, x, x, bad)


@pytest.mark.parametrize("name", ["flash_triton", "flash_pytorch"])
def test_registry_entries(name, device, generator) -> None:
    q, k, v, _ = make_inputs((2, 24, 24, 16), torch.float32, device, generator)
    q, k, v = (t.detach().view(1, 2, 24, 16) for t in (q, k, v))
    out = get_attention_fn(name)(q, k, v, True)
    ref, _ = reference_attention(q, k, v, True)
    assert rel_err(out, ref) < tolerance(torch.float32, device)


def test_tensor_descriptor_path(device, generator) -> None:
    # The TMA variant of every kernel (tensor descriptors instead of block pointers) against float64; on
    # CPU the interpreter emulates the descriptors, bounds included (ragged lengths, d = 48 padded to 64).
    with contextlib.ExitStack() as stack:
        for kernel in flash.KERNELS:
            config = replace(flash.candidate_configs(kernel, 48, torch.float32)[0], tma=True)
            stack.enter_context(flash.forced(kernel, config))
        q, k, v, do = make_inputs((2, 100, 72, 48), torch.float32, device, generator)
        check_against_reference(
            FlashAttentionTriton.apply, q, k, v, do, True, tolerance(torch.float32, device)
        )


@pytest.mark.parametrize("layout", ["3d", "model"])
def test_backward_is_deterministic(layout, device, generator) -> None:
    # The split backward has no atomics: two runs agree bit for bit (model layout: (batch, heads, seq, d)
    # views of (batch, seq, heads, d) tensors; ragged lengths, n_q != n_k).
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    if layout == "3d":
        q, k, v, do = make_inputs((2, 100, 72, 48), dtype, device, generator)
    else:
        draw = lambda n: torch.randn(2, n, 3, 48, generator=generator).to(device, dtype).transpose(1, 2)
        q, k, v = (draw(n).requires_grad_() for n in (100, 72, 72))
        do = draw(100)
    grads = [torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do) for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))


@pytest.fixture
def fake_tuner():
    """A :class:`flash.Tuner` with no GPU behind it: tuning on, no clock warm-up, no shipped table; the
    test supplies the timer."""
    with flash.configured(autotune=True, tune_cache=None):
        yield lambda timer: flash.Tuner(
            timer=timer, warm_up=lambda step: None, can_time=True, table=lambda: TuneTable(why_not="test")
        )


KEY = ("fwd-test", 1, 16, 16, 16, True, torch.float32)
CASE = (4, 64, 64, 64, True, torch.bfloat16)  # (batch * heads, n_q, n_k, d, causal, dtype)


def test_tuning_builds_every_candidate_then_times_them_in_rotated_rounds(fake_tuner) -> None:
    # Each timing runs ~5% faster than the one before (clocks ramping up after compiles, host drift). A
    # is 2% faster than B. Timed one candidate after another, or in rounds that keep the same order, B
    # looks faster; with every candidate built first and the order rotated per round, A wins.
    C = flash.TileConfig
    true_ms = {C(16, 16): 1.00, C(32, 32): 1.02, C(64, 64): 1.5}
    log: list[tuple[str, flash.TileConfig]] = []
    clock = iter(range(100))

    def fake_launch_time(step) -> float:
        step()
        c = log[-1][1]
        log.append(("timed", c))
        return true_ms[c] * (1 - 0.05 * next(clock))

    tuner = fake_tuner(fake_launch_time)
    chosen = tuner.choose("fwd", KEY, list(true_ms), lambda c: log.append(("launch", c)))
    assert log[:3] == [("launch", c) for c in true_ms], "every candidate is built before any is timed"
    timed = [c for what, c in log if what == "timed"]
    assert len(timed) == tuner.ROUNDS * len(true_ms)
    assert chosen == C(16, 16), f"picked {chosen}; rounds timed in the order {timed}"
    assert tuner.cache[KEY] == chosen and set(tuner.timings[KEY]) == {str(c) for c in true_ms}


def test_tuning_compiles_the_candidates_side_by_side_before_building_any(fake_tuner) -> None:
    # A cold key's tuning is mostly compiles: they go to Triton's AsyncCompileMode (a thread pool) and all
    # finish before the first candidate is built, as the JIT submits them (the fake compile stands in for
    # Triton's, which needs a GPU target).
    import threading
    import time

    from triton.runtime._async_compile import active_mode

    log: list[tuple] = []

    class FakeCall:
        def __init__(self, c: flash.TileConfig):
            self.c = c

        def warmup(self) -> None:
            mode = active_mode.get()
            assert mode is not None, "compiles are not submitted to a pool"

            def compile_() -> None:
                time.sleep(0.05)
                log.append(("compiled", self.c, threading.get_ident()))

            mode.submit(str(self.c), compile_, lambda kernel: None)

    candidates = [flash.TileConfig(16 * 2**i, 16) for i in range(4)]
    tuner = fake_tuner(lambda step: step() or 1.0)
    with flash.configured(compile_threads=4):
        tuner.choose("fwd", KEY, candidates, lambda c: log.append(("built", c)), lambda c: [FakeCall(c)])
    assert [e[0] for e in log[: len(candidates)]] == ["compiled"] * len(candidates), log
    assert {e[1] for e in log[: len(candidates)]} == set(candidates)
    assert len({e[2] for e in log[: len(candidates)]}) > 1, "the compiles ran on one thread"
    assert log[len(candidates)][0] == "built"


def test_flash_settings_come_from_the_environment_and_name_bad_values() -> None:
    env = {
        "CS336_FLASH_AUTOTUNE": "0",
        "CS336_FLASH_TUNE_CACHE": "/tmp/t.json",
        "CS336_FLASH_COMPILE_THREADS": "3",
        "CS336_FLASH_TUNE_TABLE": "0",
    }
    expected = flash.FlashSettings(
        autotune=False, tune_cache="/tmp/t.json", compile_threads=3, tune_table=False
    )
    assert flash.FlashSettings.from_env(env) == expected
    assert flash.FlashSettings.from_env({}).tune_table, "the shipped table is on by default"
    bad_values = {
        "CS336_FLASH_AUTOTUNE": "yes",
        "CS336_FLASH_COMPILE_THREADS": "many",
        "CS336_FLASH_TUNE_TABLE": "on",
    }
    for name, bad in bad_values.items():
        with pytest.raises(ValueError, match=name):
            flash.FlashSettings.from_env({name: bad})
    before = flash.flash_settings()
    with flash.configured(compile_threads=1) as inside:
        assert flash.flash_settings() is inside and inside.compile_threads == 1
    assert flash.flash_settings() is before


@pytest.mark.gpu
def test_sustained_metric_counts_host_time(device) -> None:
    # Calls pay our launcher's host time, so the tuner's metric must count it: a launch that spends 2 ms
    # on the host around a microseconds kernel measures about 2 ms, not the kernel's microseconds.
    import time

    from cs336_systems.kernels.flash.tuner import sustained_time_ms

    x = torch.zeros(1024, device=device)

    def launch() -> None:
        time.sleep(2e-3)
        x.add_(1)

    assert sustained_time_ms(launch, budget_ms=20, warm_ms=5) > 1.5
    assert x.sum().item() > 0


def test_tuning_key_classes() -> None:
    # Ragged lengths share their power-of-two bucket; few heads (a short grid) get their own choice,
    # and batch x heads beyond 64 all share one.
    key = lambda bh, n: flash.tune_key("fwd", bh, n, n, 64, True, torch.bfloat16)
    assert key(16, 1000) == key(16, 1024) != key(16, 1025)
    assert key(2, 1024) != key(16, 1024)
    assert key(100, 512) == key(4096, 512)
    cfg = flash.chosen_configs((100, 512, 512, 64, True, torch.bfloat16))
    assert set(cfg) == {"fwd", "dq", "dkdv"}


# -- the torch.compile'd PyTorch backward (D10) and torch.compile(apply) ---------------------------------


@pytest.mark.parametrize("variant", ["triton-fwd", "pytorch-fwd"])
def test_compiled_pytorch_backward(variant, device, generator, monkeypatch) -> None:
    if variant == "triton-fwd":
        fn = FlashAttentionTritonCompiledBackward.apply
    else:
        monkeypatch.setattr(FlashAttentionPytorch, "backward_mode", "compiled")
        fn = FlashAttentionPytorch.apply
    q, k, v, do = make_inputs((2, 100, 72, 32), torch.float32, device, generator)
    check_against_reference(fn, q, k, v, do, True, tolerance(torch.float32, device))


def test_torch_compile_apply_small(device, generator) -> None:
    q, k, v, do = make_inputs((2, 40, 40, 32), torch.bfloat16, device, generator)
    flash = torch.compile(FlashAttentionTriton.apply)
    o = flash(q, k, v, True)
    (o * do).sum().backward()
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o_ref, _ = reference_attention(q64, k64, v64, True)
    o_ref.backward(do.double())
    tol = tolerance(torch.bfloat16, device)
    assert rel_err(o, o_ref) < tol
    for x, x_ref in ((q, q64), (k, k64), (v, v64)):
        assert rel_err(x.grad, x_ref.grad) < tol


def spy_on_plans(monkeypatch) -> list[str]:
    """From now on, record each call of the plans' entry points that the custom ops call (by name)."""
    calls = []
    for name in ("flash_forward", "flash_backward"):
        original = getattr(flash, name)

        def spy(*args, _f=original, _name=name, **kwargs):
            calls.append(_name)
            return _f(*args, **kwargs)

        monkeypatch.setattr(flash, name, spy)
    return calls


@pytest.mark.gpu
def test_cuda_graphed_compile_replays_eager_plans(device, generator, monkeypatch) -> None:
    # torch.compile(mode="reduce-overhead") of a small case's step: the custom ops' bodies build the eager
    # plan in the warm-up run and the graphs record its launches, so a replay calls none of our Python and
    # matches. The loss is part of the compiled step, as in the model (the backward's inputs then live in
    # the graphs' memory pool).
    torch._dynamo.reset()
    flash.clear_tuning_cache()
    q, k, v = (torch.randn(2, 4, 256, 64, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    weight = torch.randn(2, 4, 256, 64, generator=generator).to(device)

    def step(q, k, v):
        o = FlashAttentionTriton.apply(q, k, v, True)
        return o, (o.float() * weight).sum()

    compiled = torch.compile(step, mode="reduce-overhead")

    def run() -> torch.Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        for x in (q, k, v):
            x.grad = None  # a graph's output, which the next replay overwrites: never accumulate into it
        o, loss = compiled(q, k, v)
        loss.backward()
        return o

    for _ in range(5):  # warm-up, recording (forward and backward), replays
        run()
    ran = flash.launched((8, 256, 256, 64, True, torch.bfloat16))
    assert ran is not None and ran.fwd is not None and ran.dkdv is not None, "no eager plan ran"
    calls = spy_on_plans(monkeypatch)
    o = run()
    assert not calls, f"plan calls in a replay: {calls}"
    with sdpa_kernel(SDPBackend.MATH):
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        o_ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
        (o_ref * weight).sum().backward()
    tol = tolerance(torch.bfloat16, device)
    assert rel_err(o, o_ref) < tol
    for x, x_ref in ((q, q32), (k, k32), (v, v32)):
        assert rel_err(x.grad, x_ref.grad) < tol
    eager = FlashAttentionTriton.apply(*(t.detach() for t in (q, k, v)), True)
    assert torch.equal(o, eager), "the replayed plan's output differs from an eager call's"
    torch._dynamo.reset()


@pytest.mark.gpu
def test_compiled_small_case_runs_the_eager_plan_through_the_op(device, generator, monkeypatch) -> None:
    # Compiled, every case takes the opaque custom ops, whose bodies run the call signature's eager plan:
    # one forward and one backward plan call per step, and the eager results.
    torch._dynamo.reset()
    q, k, v = (torch.randn(2, 4, 256, 64, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    compiled = torch.compile(lambda q, k, v: FlashAttentionTriton.apply(q, k, v, True))
    compiled(q, k, v).sum().backward()  # traces, tunes
    calls = spy_on_plans(monkeypatch)
    for x in (q, k, v):
        x.grad = None
    o = compiled(q, k, v)
    o.sum().backward()
    assert calls == ["flash_forward", "flash_backward"], calls
    with sdpa_kernel(SDPBackend.MATH):
        q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
        o_ref = F.scaled_dot_product_attention(q32, k32, v32, is_causal=True)
        o_ref.sum().backward()
    tol = tolerance(torch.bfloat16, device)
    assert rel_err(o, o_ref) < tol
    for x, x_ref in ((q, q32), (k, k32), (v, v32)):
        assert rel_err(x.grad, x_ref.grad) < tol
    torch._dynamo.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["3d", "model"])
def test_eager_calls_replay_from_a_cuda_graph(layout, device, generator) -> None:
    # A CUDA-graphed step (torch.compile's reduce-overhead, or a hand-captured one) records the eager
    # plan's launches: replays after new data is copied into the static inputs must match eager calls, bit
    # for bit.
    if layout == "3d":
        q, k, v, do = make_inputs((4, 256, 256, 64), torch.bfloat16, device, generator)
    else:  # (batch, heads, seq, d) views of a (batch, seq, heads, d) projection, as the model has them
        draw = lambda: (
            torch.randn(2, 256, 4, 64, generator=generator).to(device, torch.bfloat16).transpose(1, 2)
        )
        q, k, v = (draw().requires_grad_() for _ in range(3))
        do = draw()

    def step() -> torch.Tensor:
        for x in (q, k, v):
            x.grad = None
        o = FlashAttentionTriton.apply(q, k, v, True)
        o.backward(do)
        return o

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()  # plans, tuning and compiles happen here, outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_static = step()
    grads_static = [x.grad for x in (q, k, v)]
    for _ in range(2):
        with torch.no_grad():
            for x in (q, k, v, do):
                x.copy_(torch.randn(x.shape, generator=generator).to(x))
        graph.replay()
        o_eager = step()
        assert torch.equal(o_static, o_eager)
        for name, got, x in zip("qkv", grads_static, (q, k, v), strict=True):
            assert torch.equal(got, x.grad), f"d{name}"


@pytest.mark.gpu
def test_plans_launch_through_the_c_launcher_with_addresses(device, generator, monkeypatch) -> None:
    # Per launch, Triton's launcher would call data_ptr() and cuPointerGetAttribute for every tensor it
    # is given, behind a Python wrapper: the plans hand it integers, straight to its C entry point.
    q, k, v, do = make_inputs((2, 128, 128, 64), torch.bfloat16, device, generator)
    FlashAttentionTriton.apply(q, k, v, True).backward(do)  # plans, tunes, compiles
    plan = flash.attention_plan(q, k, v, True)
    backward = next(iter(plan.bwd.values()))
    kernel_plans = (plan.fwd, backward.dq, backward.dkdv)
    seen = []
    for kernel_plan in kernel_plans:
        assert kernel_plan.launch is not None
        record = lambda *args, _launch=kernel_plan.launch: seen.append(args) or _launch(*args)
        monkeypatch.setattr(kernel_plan, "launch", record)
    for x in (q, k, v):
        x.grad = None
    check_against_reference(FlashAttentionTriton.apply, q, k, v, do, True, tolerance(torch.bfloat16, device))
    assert len(seen) == len(kernel_plans)  # forward, then dQ and dK/dV
    first_tensor_args = 13  # grid (3), stream, function, then 8 launcher options
    # Addresses are integers and descriptors come encoded (tensor maps): no tensor objects reach it.
    objects = (torch.Tensor, TensorDescriptor)
    assert not any(isinstance(a, objects) for args in seen for a in args[first_tensor_args:])


@pytest.mark.gpu
def test_descriptors_are_encoded_once_per_address(device, generator, monkeypatch) -> None:
    # Triton's launcher encodes every descriptor (cuTensorMapEncodeTiled) on every launch; plans keep the
    # encoding per address. Steady calls (the caching allocator hands the same addresses back) encode
    # nothing, and new addresses are encoded, not served a stale map.
    from triton.backends.nvidia import driver

    encodes = []
    fill = driver.triton.runtime.driver.active.utils.fill_tma_descriptor
    monkeypatch.setattr(
        driver.triton.runtime.driver.active.utils,
        "fill_tma_descriptor",
        lambda *args: encodes.append(args) or fill(*args),
    )
    tma = {
        "fwd": flash.TileConfig(64, 64, 4, 3, tma=True),
        "dq": flash.TileConfig(64, 64, 4, 3, tma=True),
    }
    with flash.forced("fwd", tma["fwd"]), flash.forced("dq", tma["dq"]):
        q, k, v, do = make_inputs((2, 256, 256, 64), torch.bfloat16, device, generator)
        tol = tolerance(torch.bfloat16, device)
        for _ in range(2):  # plan, compile; O and dQ settle on their addresses
            for x in (q, k, v):
                x.grad = None
            FlashAttentionTriton.apply(q, k, v, True).backward(do)
        assert encodes, "the forced TMA configs encoded no descriptor: the test checks nothing"
        encodes.clear()
        for _ in range(3):  # the same allocations in the same order: the same addresses
            for x in (q, k, v):
                x.grad = None
            FlashAttentionTriton.apply(q, k, v, True).backward(do)
        assert not encodes, f"{len(encodes)} descriptors encoded again for addresses seen before"
        for x in (q, k, v):
            x.grad = None
        check_against_reference(FlashAttentionTriton.apply, q, k, v, do, True, tol)
        q2, k2, v2, do2 = make_inputs((2, 256, 256, 64), torch.bfloat16, device, generator)
        check_against_reference(FlashAttentionTriton.apply, q2, k2, v2, do2, True, tol)
        assert encodes, "new input addresses must be encoded"


@pytest.mark.gpu
def test_first_call_inside_graph_capture_is_refused_clearly(device, generator) -> None:
    q, k, v, _ = make_inputs((1, 96, 96, 32), torch.bfloat16, device, generator)  # a signature not seen yet
    flash.clear_plans()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="Run one call with the same shapes"), torch.cuda.graph(graph):
        FlashAttentionTriton.apply(q, k, v, True)


@pytest.mark.gpu
def test_compiled_model_with_cuda_graphs_matches_eager(device) -> None:
    # The model compiled with mode="reduce-overhead" (CUDA graphs over inductor's code, our kernels in it)
    # gives the eager model's loss and gradients, step after step.
    from cs336_systems.model import TransformerLM, get_preset

    config = get_preset("tiny").with_(attention="flash_triton", context_length=64)
    torch.manual_seed(0)
    model = TransformerLM(config, device=device)
    tokens = torch.randint(0, config.vocab_size, (2, 64), device=device)
    torch._dynamo.reset()
    graphed = torch.compile(model, mode="reduce-overhead")
    for _ in range(3):  # warm-up, record, replay
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss_graphed = graphed(tokens).float().square().mean()
        model.zero_grad(set_to_none=True)
        loss_graphed.backward()
        grads_graphed = [p.grad.clone() for p in model.parameters()]
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss_eager = model(tokens).float().square().mean()
    model.zero_grad(set_to_none=True)
    loss_eager.backward()
    torch._dynamo.reset()
    assert abs(loss_graphed.item() - loss_eager.item()) <= 2e-2 * abs(loss_eager.item())
    for p, g in zip(model.parameters(), grads_graphed, strict=True):
        assert rel_err(g, p.grad) < 5e-2


# -- bad input gets a clear error --------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_rejects_bad_input(impl, device) -> None:
    fn = IMPLS[impl].apply
    t = lambda *s, dtype=torch.float32: torch.randn(*s, device=device, dtype=dtype)
    with pytest.raises(ValueError, match="batch/head dims differ"):
        fn(t(2, 16, 32), t(3, 16, 32), t(3, 16, 32))
    with pytest.raises(ValueError, match="head dims differ"):
        fn(t(2, 16, 32), t(2, 16, 16), t(2, 16, 16))
    with pytest.raises(ValueError, match="same number of keys"):
        fn(t(2, 16, 32), t(2, 16, 32), t(2, 8, 32))
    with pytest.raises(ValueError, match="same rank"):
        fn(t(2, 16, 32), t(1, 2, 16, 32), t(1, 2, 16, 32))
    with pytest.raises(TypeError, match="dtypes differ"):
        fn(t(2, 16, 32), t(2, 16, 32, dtype=torch.bfloat16), t(2, 16, 32))
    with pytest.raises(TypeError, match="unsupported dtype"):
        fn(t(2, 16, 32, dtype=torch.float64), t(2, 16, 32), t(2, 16, 32))


def test_triton_rejects_unsupported_head_dim(device) -> None:
    for d in (8, 192):
        x = torch.randn(1, 16, d, device=device)
        with pytest.raises(ValueError, match=f"head dim {d}"):
            FlashAttentionTriton.apply(x, x, x)


def test_triton_names_missing_interpreter(monkeypatch) -> None:
    monkeypatch.setattr(flash_triton, "INTERPRET", False)
    x = torch.randn(1, 16, 16)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        FlashAttentionTriton.apply(x, x, x)


def test_pytorch_rejects_unknown_backward_mode(monkeypatch) -> None:
    monkeypatch.setattr(FlashAttentionPytorch, "backward_mode", "fast")
    x = torch.randn(1, 16, 16, requires_grad=True)
    with pytest.raises(ValueError, match="backward_mode"):
        FlashAttentionPytorch.apply(x, x, x).sum().backward()
    assert flash_pytorch.FlashAttentionPytorch.backward_mode == "fast"


# -- GPU only: larger shapes, every tuning candidate, the leaderboard case under torch.compile ------------

GPU_SHAPES = {
    "q1024-k1024": (2, 1024, 1024),
    "ragged-q1000-k1537": (1, 1000, 1537),
    "q4096-k4096": (1, 4096, 4096),
}


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_SHAPES.values(), ids=GPU_SHAPES.keys())
@pytest.mark.parametrize("d", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("is_causal", [False, True], ids=["full", "causal"])
def test_triton_large_shapes(is_causal, dtype, d, shape, device, generator) -> None:
    # The heuristic config per case (tuning every key here would compile every candidate of every case;
    # test_every_tuning_candidate covers the other candidates).
    q, k, v, do = make_inputs((*shape, d), DTYPES[dtype], device, generator)
    with flash.configured(autotune=False):
        check_against_reference(
            FlashAttentionTriton.apply, q, k, v, do, is_causal, tolerance(DTYPES[dtype], device)
        )


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", flash.KERNELS)
@pytest.mark.parametrize(("dtype", "d"), [("bf16", 64), ("bf16", 128), ("fp32", 128)])
def test_every_tuning_candidate(kernel, dtype, d, device, generator) -> None:
    # Tuning may pick any candidate that builds, so each that builds must be right (ragged lengths,
    # causal: every loop phase). One that cannot be built for this GPU is what tuning skips; the
    # heuristic default must build.
    dtype = DTYPES[dtype]
    built = []
    for config in flash.candidate_configs(kernel, d, dtype):
        q, k, v, do = make_inputs((2, 1000, 1000, d), dtype, device, generator)
        try:
            with flash.forced(kernel, config):
                check_against_reference(
                    FlashAttentionTriton.apply, q, k, v, do, True, tolerance(dtype, device)
                )
            built.append(config)
        except flash.BUILD_ERRORS as exc:
            print(f"{kernel} {config} does not build here: {type(exc).__name__}")
        except AssertionError as exc:
            raise AssertionError(f"{kernel} config {config}: {exc}") from exc
    assert flash.candidate_configs(kernel, d, dtype)[0] in built


@pytest.mark.gpu
def test_torch_compile_apply_leaderboard_case(device, generator) -> None:
    # Exactly how the leaderboard calls it: heads folded into batch, bf16, causal, compiled apply.
    n_heads, seq, d_head = 16, 16384, 64
    q, k, v = torch.randn(3, n_heads, seq, d_head, generator=generator).to(device, torch.bfloat16)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = torch.randn(n_heads, seq, d_head, generator=generator).to(device, torch.bfloat16)
    flash = torch.compile(FlashAttentionTriton.apply)
    o = flash(q, k, v, True)
    (o * do).sum().backward()
    # Reference: torch's fused attention on float32 copies (float64 scores would need 34 GB here).
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):  # pinned: the math backend would need ~50 GB here
        o_ref = F.scaled_dot_product_attention(q32[None], k32[None], v32[None], is_causal=True)[0]
    o_ref.backward(do.float())
    tol = tolerance(torch.bfloat16, device)
    assert rel_err(o, o_ref) < tol
    for x, x_ref in ((q, q32), (k, k32), (v, v32)):
        assert rel_err(x.grad, x_ref.grad) < tol
