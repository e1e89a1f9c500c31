"""Model FLOPs of a step, the measured dense-matmul rate of the device, and MFU.

Convention (stated once, used by every bench and table):
- A matmul of (m, k) @ (k, n) costs 2·m·k·n FLOPs. "Model FLOPs" counts matmuls only: the QKV,
  output, SwiGLU and LM-head projections and attention's two matmuls QKᵀ and PV. Causal attention is
  NOT halved: the model computes the full T×T scores and masks them, so that work is really done.
- Backward costs twice the forward (gradient w.r.t. input and w.r.t. weight for every projection;
  dQ, dK and dP, dV for attention), so forward+backward = 3× forward.
- The optimizer step and elementwise work (norms, RoPE, SiLU, softmax, loss) are not counted: they
  are O(parameters) or O(activations), well under 1% of the matmul FLOPs at the Table 1 sizes. The
  softmax estimate (5 FLOPs per score: max, subtract, exp, sum, divide) is reported separately for
  the D3 "softmax time vs FLOPs" question.
These counts match ``torch.utils.flop_counter.FlopCounterMode`` on the model exactly (tested).
"""

from __future__ import annotations

import timeit
from dataclasses import asdict, dataclass

import torch

from cs336_systems.model.config import ModelConfig
from cs336_systems.profiling.timing import synchronize

MODES = ("fwd", "fwd_bwd", "train")
SOFTMAX_FLOPS_PER_SCORE = 5


@dataclass(frozen=True)
class ForwardFlops:
    """Forward-pass FLOPs of the whole model (all layers) for one batch, split by component."""

    qkv_proj: int
    attn_scores: int  # QKᵀ
    attn_values: int  # softmax(S) V
    output_proj: int
    ffn: int  # SwiGLU: w1, w3 (d -> d_ff) and w2 (d_ff -> d)
    lm_head: int
    attn_softmax: int  # elementwise estimate, NOT part of `total`

    @property
    def total(self) -> int:
        """Matmul FLOPs of one forward pass."""
        return (
            self.qkv_proj + self.attn_scores + self.attn_values + self.output_proj + self.ffn + self.lm_head
        )

    def as_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def forward_flops(config: ModelConfig, batch: int, ctx: int) -> ForwardFlops:
    tokens = batch * ctx
    d, layers = config.d_model, config.num_layers
    scores = batch * config.num_heads * ctx * ctx  # entries of the (B, H, T, T) score tensor
    return ForwardFlops(
        qkv_proj=layers * 2 * tokens * d * 3 * d,
        attn_scores=layers * 2 * scores * config.d_head,
        attn_values=layers * 2 * scores * config.d_head,
        output_proj=layers * 2 * tokens * d * d,
        ffn=layers * 3 * 2 * tokens * d * config.d_ff,
        lm_head=2 * tokens * d * config.vocab_size,
        attn_softmax=layers * SOFTMAX_FLOPS_PER_SCORE * scores,
    )


def step_flops(config: ModelConfig, batch: int, ctx: int, mode: str) -> int:
    """Model FLOPs of one step of ``mode``: fwd = F, fwd_bwd = train = 3F (optimizer not counted)."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; choose one of {MODES}")
    forward = forward_flops(config, batch, ctx).total
    return forward if mode == "fwd" else 3 * forward


# MFU is quoted two ways (issue 51), and each figure names its convention:
# - against the dense matmul rate measured in the same process (what this GPU really sustains);
# - against the vendor's dense bf16 peak (no sparsity) of the GPU model, the figure papers quote.
# Longest name first: "H100 PCIe" must not match "H100".
DENSE_BF16_PEAK_TFLOPS: dict[str, float] = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "H100": 989.0,  # SXM
    "H200 NVL": 835.0,
    "H200": 989.0,  # SXM
    "A100": 312.0,
}
# The FLOP count behind each MFU, named where it is printed.
MODEL_FLOP_FORMULA = (
    "model FLOPs = matmuls only, fwd+bwd = 3 x forward (~6N per token) + attention's QK^T and PV "
    "over the full masked T x T scores; recomputation and the optimizer not counted"
)
STEP_8B_FLOP_FORMULA = (
    "model FLOPs = 6N per token + causal attention 6*L*S^2*D per sequence; recomputation not counted"
)


def dense_bf16_peak_tflops(device_name: str) -> float | None:
    """The vendor's dense bf16 peak of the GPU named ``device_name`` (None: a GPU not in the table)."""
    for model in sorted(DENSE_BF16_PEAK_TFLOPS, key=len, reverse=True):
        if model.lower() in device_name.lower():
            return DENSE_BF16_PEAK_TFLOPS[model]
    return None


def mfu_both(model_flops_per_s: float, measured_matmul_flops: float | None, device_name: str) -> dict:
    """MFU against the measured matmul rate and against the GPU's dense bf16 peak (both rates in
    FLOP/s). Keys: ``mfu`` (measured; absent when not measured), ``mfu_peak`` and ``peak_tflops``
    (absent for a GPU not in DENSE_BF16_PEAK_TFLOPS) and ``mfu_note``, one line saying which is which."""
    out: dict[str, float | str] = {}
    notes = []
    if measured_matmul_flops:
        out["mfu"] = model_flops_per_s / measured_matmul_flops
        notes.append(
            f"{out['mfu']:.1%} of the measured matmul rate {measured_matmul_flops / 1e12:.3g} TFLOP/s"
        )
    peak = dense_bf16_peak_tflops(device_name)
    if peak is not None:
        out["mfu_peak"] = model_flops_per_s / (peak * 1e12)
        out["peak_tflops"] = peak
        notes.append(f"{out['mfu_peak']:.1%} of the dense bf16 peak {peak:g} TFLOP/s")
    else:
        notes.append(f"no dense bf16 peak known for {device_name!r}: measured rate only")
    out["mfu_note"] = "MFU " + "; ".join(notes)
    return out


def mfu(flops: float, seconds: float, peak_tflops: float) -> float:
    """Model FLOPs utilization: achieved FLOP/s over the peak rate (in TFLOP/s) of the same precision."""
    if seconds <= 0 or peak_tflops <= 0:
        raise ValueError(f"need positive time and peak rate, got {seconds=} {peak_tflops=}")
    return flops / seconds / (peak_tflops * 1e12)


_MATMUL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def measure_matmul_tflops(
    device: torch.device | str,
    dtype: torch.dtype,
    n: int | None = None,
    iters: int | None = None,
    trials: int = 3,
) -> float:
    """Dense n×n×n matmul rate in TFLOP/s on ``device`` (best of ``trials``): the MFU denominator.

    n defaults to 8192 on a GPU (big enough to saturate an H100) and 512 on the CPU (a smoke value:
    CPU MFU numbers mean little). fp32 runs with whatever ``torch.backends.cuda.matmul`` / float32
    matmul precision is set at call time, i.e. the same setting the model runs with (torch default:
    full fp32, no TF32), so fp32 MFU is against the fp32 rate actually available to the model.
    """
    device = torch.device(device)
    if dtype not in _MATMUL_DTYPES:
        raise ValueError(f"matmul rate is measured for {_MATMUL_DTYPES}, got {dtype}")
    on_gpu = device.type == "cuda"
    n = n or (8192 if on_gpu else 512)
    iters = iters or (20 if on_gpu else 3)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):  # warm-up: cuBLAS handle, heuristics, clocks
        torch.mm(a, b, out=out)
    synchronize(device)
    best = float("inf")
    for _ in range(trials):
        start = timeit.default_timer()
        for _ in range(iters):
            torch.mm(a, b, out=out)
        synchronize(device)
        best = min(best, (timeit.default_timer() - start) / iters)
    return 2 * n**3 / best / 1e12


# Attention alone (the attention benches, D6/D11/D12). Backward does 2.5x the forward's matmul FLOPs
# (5 matmuls against 2, with P recomputed in FA2), the convention of the FlashAttention papers.
PASS_FLOP_FACTOR: dict[str, float] = {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}


def attention_flops(
    batch: int,
    seq: int,
    d: int,
    *,
    heads: int = 1,
    causal: bool = True,
    pass_: str = "fwd",
    n_keys: int | None = None,
) -> float:
    """Matmul FLOPs of attention: forward = 2 matmuls (Q K^T and P V) of seq x n_keys x d multiply-adds,
    2 FLOPs each, i.e. 4 * seq * n_keys * d per (batch, head); causal halves it (half the tiles are
    masked); backward = 2.5 x forward. Softmax and masking are not counted (they are not matmuls)."""
    if pass_ not in PASS_FLOP_FACTOR:
        raise ValueError(f"unknown pass {pass_!r}; choose one of {list(PASS_FLOP_FACTOR)}")
    n_keys = seq if n_keys is None else n_keys
    fwd = 4.0 * batch * heads * seq * n_keys * d
    if causal:
        fwd *= 0.5
    return fwd * PASS_FLOP_FACTOR[pass_]


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12
