"""The Gluon (Hopper) FlashAttention kernels: built for sm_90a on the CPU (their matmuls overlapped, no
spills beyond what is measured, 16-byte epilogues, the model's layouts), and on an H100 against the float64
reference; the one-pass backward's plan and its deterministic fallback; where Gluon cannot run, the Triton
kernel with the same tiles."""

from __future__ import annotations

import re

import pytest
import torch

from cs336_systems.attention.flash_triton import FlashAttentionTriton
from cs336_systems.kernels import flash
from cs336_systems.kernels.flash import OnePassBackward, SplitBackward

from .helpers.attention import check_against_reference, make_inputs, rel_err, tolerance

GLUON_CONFIGS = [
    (kernel, d, c)
    for kernel in flash.KERNELS
    for d in (64, 128)
    for c in flash.gpu_candidates(kernel, d, torch.bfloat16)
    if c.gluon
]
GLUON_IDS = [f"{kernel}-d{d}-{c}" for kernel, d, c in GLUON_CONFIGS]


def gluon_kernel(kernel: str, config):
    """The Gluon kernel that ``config`` launches for ``kernel``."""
    if config.one_pass:
        return flash.flash_bwd_one_pass_ws_kernel
    if config.ws:
        return {
            "fwd": flash.flash_fwd_ws_kernel,
            "dq": flash.flash_bwd_dq_ws_kernel,
            "dkdv": flash.flash_bwd_dkdv_ws_kernel,
        }[kernel]
    return {
        "fwd": flash.flash_fwd_gluon_kernel,
        "dq": flash.flash_bwd_dq_gluon_kernel,
        "dkdv": flash.flash_bwd_dkdv_gluon_kernel,
    }[kernel]


def _ptxas_report(ptx: str) -> str:
    """ptxas's own report (registers, spills, performance notes) on a kernel's PTX, for sm_90a."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(90).path  # the one Triton builds with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        out = subprocess.run(
            [ptxas, "-v", "--gpu-name=sm_90a", f.name, "-o", "/dev/null"], capture_output=True
        )
    assert out.returncode == 0, out.stderr.decode()
    return out.stderr.decode()


def _gluon_signature(kernel: str, d: int, config) -> dict[str, str]:
    """The argument types of a Gluon kernel's bf16 launch with ``config``'s tiles (descriptors by their
    box and swizzle)."""
    from triton.experimental.gluon import language as gl

    def desc(shape, dtype, name):
        layout = gl.NVMMASharedLayout.get_default_for(shape, dtype)
        return f"tensordesc<{name}[{', '.join(map(str, shape))}],{layout!r}>"

    q_rows, k_rows = (
        desc([config.q_tile, d], gl.bfloat16, "bf16"),
        desc([config.k_tile, d], gl.bfloat16, "bf16"),
    )
    vector = desc([config.q_tile], gl.float32, "fp32")
    dq_acc = {"dq_acc_desc": desc([config.q_tile, d // 2], gl.float32, "fp32")} if config.one_pass else {}
    head = {
        "fwd": {"q_desc": q_rows, "k_desc": k_rows, "v_desc": k_rows, "O_ptr": "*bf16", "L_ptr": "*fp32"},
        "dq": {"q_desc": q_rows, "k_desc": k_rows, "v_desc": k_rows, "O_ptr": "*bf16", "do_desc": q_rows,
               "L_ptr": "*fp32", "Delta_ptr": "*fp32", "dQ_ptr": "*bf16"},
        "dkdv": {"q_desc": q_rows, "k_desc": k_rows, "v_desc": k_rows, "do_desc": q_rows, "l_desc": vector,
                 "delta_desc": vector, "dK_ptr": "*bf16", "dV_ptr": "*bf16", **dq_acc},
    }[kernel]  # fmt: skip
    o_strides = {"stride_ob": "i32", "stride_oh": "i32", "stride_on": "i32"}
    return {
        **head,
        **(o_strides if kernel in ("fwd", "dq") else {}),
        "H": "i32",
        "N_QUERIES": "i32",
        "N_KEYS": "i32",
        "scale": "fp32",
    }


def _build_for_hopper(kernel: str, d: int, config, is_causal: bool, seq_major: int = 0) -> tuple[str, str]:
    """A Gluon kernel's bf16 launch with ``config`` built for sm_90a on the CPU: its PTX and ptxas's
    report. ``seq_major``: SEQ_MAJOR of the kernels that read either layout (the dK/dV and the
    warp-specialized passes): which of Q, K, V, dO and the gradients are seq-major."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = dict(D=d, BM=config.q_tile, BN=config.k_tile, is_causal=is_causal, WARPS=config.num_warps)
    if kernel == "dkdv" or config.ws:
        constexprs["SEQ_MAJOR"] = seq_major
    if kernel != "dkdv" or config.ws:  # the ring depth (the non-specialized dK/dV pass's is fixed)
        constexprs["STAGES"] = config.num_stages
    signature = {**_gluon_signature(kernel, d, config), **dict.fromkeys(constexprs, "constexpr")}
    # What Triton's launcher specializes on a GPU: 16-byte aligned pointers, and strides and lengths that are
    # multiples of 16 (as at the shapes that matter). Without it no global access is wider than an element.
    multiples = ("stride_ob", "stride_oh", "stride_on", "N_QUERIES", "N_KEYS")
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, (name, kind) in enumerate(signature.items())
        if kind.startswith("*") or name in multiples
    }
    source = GluonASTSource(gluon_kernel(kernel, config), signature, constexprs, attrs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=config.num_warps)
    )
    return compiled.asm["ptx"], _ptxas_report(compiled.asm["ptx"])


def _assert_overlapped_without_spills(
    ptx: str, report: str, spill_bytes: int = 0, one_pass: bool = False
) -> None:
    assert "C7514" not in report and "serialized" not in report, report
    assert "wgmma.mma_async" in ptx
    spilled = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    assert spilled <= spill_bytes, report
    # The split passes add nothing atomically; the one-pass kernel adds dQ's shares by the copy engine only.
    assert ("cp.reduce.async.bulk.tensor" in ptx) == one_pass
    assert "red.global" not in ptx and "atom.global" not in ptx


def _spill_allowance(kernel: str, d: int, config, model_layout: bool) -> int:
    """Spill bytes the ptxas of Triton 3.6 leaves at the 240 registers of a warp-specialized consumer. The
    one-pass consumer at d = 128 spills loop-invariant scalars (addresses), 56-68 bytes, reloaded from L1
    in the loop; it measured 0.94x the split backward's time at (1, 32, 32768, 128) all the same."""
    if config.one_pass:
        return 72 if d == 128 else 0
    if kernel == "dkdv" and d == 128:
        # A seq-major head's origin is a (row, column) pair, and the dK/dV stores need H after the loop.
        return 16 if model_layout else (4 if config.ws else 0)
    return 0


@pytest.mark.usefixtures("pristine_triton_language")
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("kernel", "d", "config"), GLUON_CONFIGS, ids=GLUON_IDS)
def test_gluon_kernels_build_for_hopper_with_overlapped_matmuls(kernel, d, config, is_causal) -> None:
    # Built for sm_90a on the CPU. The kernels exist for their asynchronous matmuls: if ptxas serializes
    # them (C7514: e.g. an accumulator left in flight across the loop's back edge) or spills in the loop,
    # they are the Triton kernels with extra steps. Also runs where no GPU is present.
    spill_bytes = _spill_allowance(kernel, d, config, model_layout=False)
    ptx, report = _build_for_hopper(kernel, d, config, is_causal)
    _assert_overlapped_without_spills(ptx, report, spill_bytes, config.one_pass)


# The kernels that read the model's layout, and its SEQ_MAJOR for each (bit i: Q, K, V, dO, then the
# gradients). Q and K are contiguous (RoPE writes them); V is a view of the fused QKV projection, dO comes in
# O's (batch, seq, heads, d) layout, and dV is laid out as V (empty_like keeps a view's order of strides).
MODEL_LAYOUT = {"fwd": 0b100, "dq": 0b01100, "dkdv": 0b101100}
LAYOUT_GLUON = [(kernel, d, c) for kernel, d, c in GLUON_CONFIGS if kernel == "dkdv" or c.ws]
LAYOUT_IDS = [f"{kernel}-d{d}-{c}" for kernel, d, c in LAYOUT_GLUON]


WS_GLUON = [(kernel, d, c) for kernel, d, c in GLUON_CONFIGS if c.ws]


@pytest.mark.usefixtures("pristine_triton_language")
@pytest.mark.parametrize(("kernel", "d", "config"), WS_GLUON, ids=[f"{k}-d{d}-{c}" for k, d, c in WS_GLUON])
def test_warp_specialized_epilogues_move_16_byte_rows(kernel, d, config) -> None:
    # The tiles a warp-specialized pass writes (O, dQ, dK and dV) and the O the dQ pass reads go through
    # global memory in 16-byte row vectors, not in the wgmma accumulator layout's 4-byte pieces (10-16% of a
    # pass at short sequences). What stays narrower: the L and D vectors, one 4-byte access a row.
    ptx, _ = _build_for_hopper(kernel, d, config, True, seq_major=MODEL_LAYOUT[kernel])
    stores, loads = re.findall(r"st\.global\.([\w.]+)", ptx), re.findall(r"ld\.global\.([\w.]+)", ptx)
    tiles = {"fwd": 1, "dq": 1, "dkdv": 2}[kernel]  # per consumer: O; dQ; dK and dV
    rows_per_thread = 64 * d * 2 // 16 // 128  # a consumer's 64 rows of d 2-byte elements, 128 threads
    assert stores.count("v4.b32") == 2 * tiles * rows_per_thread, stores
    assert [s for s in stores if s != "v4.b32"] == (["b32"] * 4 if kernel != "dkdv" else []), stores
    if kernel == "dq":  # O, for D = rowsum(dO * O); and L
        assert sorted(loads) == sorted(["v4.b32"] * 2 * rows_per_thread + ["b32"] * 4), loads


@pytest.mark.usefixtures("pristine_triton_language")
@pytest.mark.parametrize(("kernel", "d", "config"), LAYOUT_GLUON, ids=LAYOUT_IDS)
def test_gluon_kernels_build_for_the_model_layout(kernel, d, config) -> None:
    # Seq-major tensors: other coordinates, the same loop. The warp-specialized passes: 3 partitions in
    # 384 threads, the consumer worker given 240 registers a thread and the producer warp 24.
    ptx, report = _build_for_hopper(kernel, d, config, True, seq_major=MODEL_LAYOUT[kernel])
    spill_bytes = _spill_allowance(kernel, d, config, model_layout=True)
    _assert_overlapped_without_spills(ptx, report, spill_bytes, config.one_pass)
    if config.ws:
        assert ".reqntid 384" in ptx
        assert "setmaxnreg.inc.sync.aligned.u32 \t240;" in ptx
        assert "setmaxnreg.dec.sync.aligned.u32 \t24;" in ptx


def _calls(kernel: str, config, is_causal: bool, q, k, v, do):
    """``kernel``'s launch for these 4-D tensors as :func:`flash.resolve` lets ``config`` run (scratch
    outputs: only the chosen function is read), and that choice."""
    lse = torch.empty(q.shape[:-1], device=q.device)
    o = flash.new_output(q)  # the plan's layout: (batch, seq, heads, d) underneath
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    hopper = q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)
    facts = flash.layouts_of(hopper, q=q, k=k, v=v, o=o, do=do, lse=lse, dq=dq, dk=dk, dv=dv)
    case = flash.Case(q.shape[0] * q.shape[1], q.shape[2], k.shape[2], q.shape[3], is_causal, q.dtype)
    choice = flash.resolve(kernel, config, case, facts)
    c = choice.config
    if kernel == "fwd":
        return flash.fwd_launch(c, is_causal, q, k, v, o, lse), choice
    if kernel == "dq":
        return flash.dq_launch(c, is_causal, q, k, v, o, do, lse, lse, dq), choice
    if c.one_pass:
        acc = q.new_empty(q.numel() // q.shape[-1], q.shape[-1], dtype=torch.float32)
        return flash.one_pass_launches(c, is_causal, q, k, v, o, do, lse, lse, dk, dv, acc)[1], choice
    return flash.dkdv_launch(c, is_causal, q, k, v, do, lse, lse, dk, dv), choice


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("kernel", "d", "config"), GLUON_CONFIGS, ids=GLUON_IDS)
def test_gluon_kernels_match_the_reference(kernel, d, config, is_causal, hopper, generator) -> None:
    # Shapes the Gluon kernels take (contiguous, lengths multiples of the tiles), one with N_q != N_k both
    # ways: every loop phase (diagonal tiles, full tiles, key tiles that no query sees), and one long
    # enough that every ring of tiles wraps several times, taken as 4-D (2 x 4 heads of 1024) for O's layout.
    for shape in ((3, 256, 256, d), (2, 128, 384, d), (2, 384, 128, d), (1, 8192, 8192, d)):
        q, k, v, do = make_inputs(shape, torch.bfloat16, hopper, generator)
        if shape[0] == 1:  # as (batch, heads, seq, d): O strided as the plan stores it, heads apart
            q, k, v, do = (
                t.detach().view(2, 4, -1, d).requires_grad_(t.requires_grad) for t in (q, k, v, do)
            )
        q4, k4, v4, do4 = (flash.as_4d(t.detach()) for t in (q, k, v, do))
        call, choice = _calls(kernel, config, is_causal, q4, k4, v4, do4)
        assert call.fn is gluon_kernel(kernel, config), f"the Gluon kernel must apply here: {choice.refused}"
        assert choice.kernel == call.fn.fn.__name__
        with flash.forced(kernel, config):
            check_against_reference(
                FlashAttentionTriton.apply, q, k, v, do, is_causal, tolerance(torch.bfloat16, hopper)
            )


@pytest.mark.gpu
@pytest.mark.parametrize("is_causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize(("kernel", "d", "config"), LAYOUT_GLUON, ids=LAYOUT_IDS)
def test_gluon_kernels_read_the_model_layout(kernel, d, config, is_causal, hopper, generator) -> None:
    # The model's attention (MODEL_LAYOUT): the Gluon kernel reads its views in place.
    batch, heads, n = 2, 4, 1024
    draw = lambda *shape: torch.randn(*shape, generator=generator).to(hopper, torch.bfloat16)
    qkv = draw(batch, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    q, k = (t.contiguous().requires_grad_() for t in qkv[:2])
    v = qkv[2].detach().requires_grad_()
    do = draw(batch, n, heads, d).transpose(1, 2)
    call, choice = _calls(kernel, config, is_causal, q.detach(), k.detach(), v.detach(), do)
    assert call.fn is gluon_kernel(kernel, config), choice.refused
    assert call.constexprs["SEQ_MAJOR"] == MODEL_LAYOUT[kernel]
    with flash.forced(kernel, config):
        check_against_reference(
            FlashAttentionTriton.apply, q, k, v, do, is_causal, tolerance(torch.bfloat16, hopper)
        )


def test_gluon_descriptor_layouts() -> None:
    # Which (batch, heads, seq, d) layouts a 2-D descriptor of [tile, d] boxes can read in place.
    from cs336_systems.kernels.flash.select import seq_major

    x = torch.empty(2, 4, 64, 32, dtype=torch.bfloat16)
    assert seq_major(x) is False  # contiguous: head-major rows
    assert seq_major(torch.empty(2, 64, 4, 32, dtype=torch.bfloat16).transpose(1, 2)) is True  # O's layout
    qkv = torch.empty(2, 64, 3, 4, 32, dtype=torch.bfloat16).permute(2, 0, 3, 1, 4)
    assert seq_major(qkv[2]) is True  # the model's V
    assert seq_major(x.transpose(-2, -1).contiguous().transpose(-2, -1)) is None  # d not contiguous
    batch_inside_heads = torch.empty(4, 2, 64, 32, dtype=torch.bfloat16).transpose(0, 1)
    assert seq_major(batch_inside_heads) is None
    misaligned = torch.empty(2 * 4 * 64 * 32 + 1, dtype=torch.bfloat16)[1:].view(2, 4, 64, 32)
    assert seq_major(misaligned) is None  # the copy engine needs 16-byte aligned bases


@pytest.mark.parametrize("kernel", ["fwd", "dq", "dkdv"])
def test_gluon_configs_fall_back_to_triton_where_gluon_cannot_run(kernel, device, generator) -> None:
    # Ragged lengths (and CPU tensors, and non-Hopper GPUs): the same tiles through the Triton kernel, and
    # the choice says so, with the reason.
    config = next(c for name, _, c in GLUON_CONFIGS if name == kernel)
    q, k, v, do = (
        flash.as_4d(t.detach()) for t in make_inputs((2, 100, 100, 64), torch.bfloat16, device, generator)
    )
    call, choice = _calls(kernel, config, True, q, k, v, do)
    triton_kernel = {"fwd": flash.flash_fwd_kernel, "dq": flash.flash_bwd_dq_kernel}.get(
        kernel, flash.flash_bwd_dkdv_kernel
    )
    assert call.fn is triton_kernel
    assert choice.kernel == triton_kernel.fn.__name__ and not choice.config.gluon
    assert choice.requested == config and any(r.startswith("gluon: ") for r in choice.refused)
    # So every Gluon config's tiles must be ones the Triton kernel takes.
    for name, _, c in GLUON_CONFIGS:
        steps = (c.k_tile, c.q_tile) if name == "dkdv" else (c.q_tile, c.k_tile)
        assert steps[0] % steps[1] == 0, f"{name} {c}: the Triton fallback needs tiles that divide"
    assert (call.constexprs["Q_TILE_SIZE"], call.constexprs["K_TILE_SIZE"]) == (config.q_tile, config.k_tile)


# The d = 128 candidate; at d = 64 (listed nowhere: the tuner never chose it) the same tiles.
ONE_PASS = next(c for c in flash.gpu_candidates("dkdv", 128, torch.bfloat16) if c.one_pass)


@pytest.mark.gpu
@pytest.mark.parametrize("d", [64, 128])
def test_one_pass_backward_and_its_deterministic_twin(d, hopper, generator) -> None:
    # A one-pass dK/dV config runs the whole backward as the one-pass plan (no dQ pass). Its dK and dV are
    # the split twin's (the same loop body; D summed in another order: last bits); dQ's shares are added in
    # no fixed order, so under torch.use_deterministic_algorithms the split twin runs, and two runs agree
    # bit for bit. Break tried: without the consumers' wait for each other's dS^T, dQ is off by 1.19.
    q, k, v, do = (
        t.detach().view(2, 4, 1024, d).requires_grad_(t.requires_grad)
        for t in make_inputs((8, 1024, 1024, d), torch.bfloat16, hopper, generator)
    )

    def grads() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(FlashAttentionTriton.apply(q, k, v, True), (q, k, v), do)

    with flash.forced("dkdv", ONE_PASS):
        one_pass = grads()
        (plan,) = flash.PLANS.values()
        assert [type(b) for b in plan.bwd.values()] == [OnePassBackward]
        torch.use_deterministic_algorithms(True)
        try:
            split, again = grads(), grads()
        finally:
            torch.use_deterministic_algorithms(False)
        assert [type(b) for b in plan.bwd.values()] == [OnePassBackward, SplitBackward]
    assert all(torch.equal(a, b) for a, b in zip(split, again, strict=True))
    assert rel_err(one_pass[1], split[1]) < 1e-4 and rel_err(one_pass[2], split[2]) < 1e-4
    assert rel_err(one_pass[0], split[0]) < 2e-3


def test_one_pass_preprocess_writes_delta_and_zeroes_the_accumulator(device, generator) -> None:
    # The one-pass backward's first launch: D = rowsum(dO ∘ O) for O in the plan's layout and dO in the
    # model's ((batch, seq, heads, d) underneath both), and zeros over the float32 accumulator it adds into.
    b, h, n, d = 2, 3, 128, 64
    draw = lambda *shape: torch.randn(*shape, generator=generator).to(device)
    o, do = draw(b, n, h, d).transpose(1, 2), draw(b, n, h, d).transpose(1, 2)
    delta = torch.empty(b, h, n, device=device)
    acc = torch.full((b * h * n, d), float("nan"), device=device)
    flash.flash_bwd_delta_kernel[(n // 64, b * h)](
        o, do, delta, acc, *o.stride(), *do.stride(), h, n, D=d, ROWS=64
    )
    torch.testing.assert_close(delta, (o * do).sum(-1))
    assert torch.equal(acc, torch.zeros_like(acc))
