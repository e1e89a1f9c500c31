"""Closed-form answers of the handout's accounting questions (D5d, D6, D17b, D18, D20c).

Every answer is a small function whose docstring carries the derivation and whose result is plain
numbers (dataclasses and floats, no prose: ``report.answers`` writes the Markdown). Units: bytes unless a name
says otherwise; MiB = 2**20 bytes, GiB = 2**30 bytes, GB = 1e9 bytes (the handout's "80GB" / "95GB"
device sizes are read as decimal GB, and the text says where that choice matters).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cache

from cs336_systems.distributed.sharded_optimizer import assign_owners
from cs336_systems.model import BATCH_SIZE, ModelConfig, TransformerLM

MiB = 2**20
GiB = 2**30
GB = 10**9
FP32, BF16 = 4, 2

D6_BATCH = 8
D6_HEAD_DIMS = (16, 32, 64, 128)
D6_SEQ_LENS = (256, 1024, 4096, 8192, 16384)
H100_BYTES = 80 * GiB  # the "80 GB" card: 80 GiB of HBM3 (torch reports ~79.2 GiB usable)


# --------------------------------------------------------------------------------------------------
# D5d / D5e: activation sizes of the 2.7B model
# --------------------------------------------------------------------------------------------------


def residual_stream_bytes(
    config: ModelConfig, ctx: int, batch: int = BATCH_SIZE, bytes_per_element: int = FP32
) -> int:
    """One residual-stream activation tensor, shape (batch, ctx, d_model).

    bytes = batch · ctx · d_model · bytes_per_element; for the 2.7B model (d_model 2560) at the reference
    batch 4 in fp32: 4 · ctx · 2560 · 4 = 40,960 · ctx bytes, i.e. 5 / 10 / 20 MiB at ctx 128 / 256 / 512.
    """
    return batch * ctx * config.d_model * bytes_per_element


def largest_forward_tensors(
    config: ModelConfig, ctx: int, batch: int = BATCH_SIZE, bytes_per_element: int = FP32
) -> dict[str, int]:
    """Sizes of the biggest single tensors a forward pass allocates (D5e: what memory_viz shows at a
    low "Detail" level), largest first:

    - attention scores / probabilities of one layer: batch · heads · ctx² elements (plain attention
      materializes them);
    - logits of the LM head: batch · ctx · vocab;
    - the SwiGLU hidden activations (w1 x, w3 x, their product) of one layer: batch · ctx · d_ff each;
    - the fused QKV projection of one layer: batch · ctx · 3·d_model.
    """
    b, t, e = batch, ctx, bytes_per_element
    sizes = {
        "attention scores (one layer)": b * config.num_heads * t * t * e,
        "logits": b * t * config.vocab_size * e,
        "feed-forward hidden (one layer)": b * t * config.d_ff * e,
        "QKV projection (one layer)": b * t * 3 * config.d_model * e,
    }
    return dict(sorted(sizes.items(), key=lambda kv: -kv[1]))


# --------------------------------------------------------------------------------------------------
# D6: memory of plain PyTorch attention
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionMemory:
    """Memory of one plain-PyTorch attention forward/backward (``attention/reference.py``)."""

    batch: int
    seq: int
    d: int
    bytes_per_element: int = FP32
    causal: bool = False

    @property
    def score_matrix(self) -> int:
        """One (batch, seq, seq) matrix: scores S, probabilities P, or a gradient of either."""
        return self.batch * self.seq * self.seq * self.bytes_per_element

    @property
    def vector_tensor(self) -> int:
        """One (batch, seq, d) tensor: q, k, v, the output O or a gradient of one."""
        return self.batch * self.seq * self.d * self.bytes_per_element

    @property
    def saved_for_backward(self) -> int:
        """What autograd keeps from the forward: q and k (saved by ``q @ kᵀ``), P (saved by softmax and
        by ``P @ v``, one tensor) and v. The scaled scores are not kept: division by a Python scalar
        and the additive mask save nothing. So: one score matrix + 3 (batch, seq, d) tensors."""
        return self.score_matrix + 3 * self.vector_tensor

    @property
    def before_backward(self) -> int:
        """In use when backward starts: the saved tensors plus the output O."""
        return self.saved_for_backward + self.vector_tensor

    @property
    def forward_peak(self) -> int:
        """Two score matrices are alive at once in the forward (S beside S/√d, then S beside P); causal
        masking adds one (seq, seq) additive bias (not batched) and its bool mask."""
        mask = self.seq * self.seq * (self.bytes_per_element + 1) if self.causal else 0
        return 2 * self.score_matrix + 4 * self.vector_tensor + mask

    @property
    def backward_peak(self) -> int:
        """Softmax backward holds P, dP and dS at once: three score matrices, plus q, k, v, O, dO and
        the (batch, seq, d) gradients being produced."""
        return 3 * self.score_matrix + 8 * self.vector_tensor

    @property
    def peak(self) -> int:
        return max(self.forward_peak, self.backward_peak)


def attention_memory(
    seq: int, d: int, batch: int = D6_BATCH, bytes_per_element: int = FP32, causal: bool = False
) -> AttentionMemory:
    """Memory accounting of plain attention: the seq² terms dominate (see :class:`AttentionMemory`).

    Saved for backward = batch·seq²·4 (P) + 3·batch·seq·d·4 (q, k, v) bytes, so it grows
    quadratically in seq: doubling seq multiplies it by ~4 (exactly 4 for the seq² part).
    """
    return AttentionMemory(batch, seq, d, bytes_per_element, causal)


def smallest_oom_case(
    capacity_bytes: int = H100_BYTES,
    head_dims: Sequence[int] = D6_HEAD_DIMS,
    seq_lens: Sequence[int] = D6_SEQ_LENS,
    batch: int = D6_BATCH,
    causal: bool = False,
) -> AttentionMemory | None:
    """The smallest grid case (by seq, then d) whose predicted peak exceeds the card, or None."""
    for seq in sorted(seq_lens):
        for d in sorted(head_dims):
            case = attention_memory(seq, d, batch, causal=causal)
            if case.peak > capacity_bytes:
                return case
    return None


def first_oom_seq(
    capacity_bytes: int = H100_BYTES,
    d: int = 16,
    batch: int = D6_BATCH,
    start: int = 256,
    causal: bool = False,
) -> AttentionMemory:
    """Doubling seq from ``start``, the first power-of-two length whose predicted peak exceeds the card
    (extends the D6 grid when none of its cases runs out)."""
    seq = start
    while attention_memory(seq, d, batch, causal=causal).peak <= capacity_bytes:
        seq *= 2
    return attention_memory(seq, d, batch, causal=causal)


# --------------------------------------------------------------------------------------------------
# D17b: DDP overhead with buckets
# --------------------------------------------------------------------------------------------------


def ddp_overhead_s(s: float, w: float, o: float, n_b: float) -> float:
    """Time spent after the backward pass by bucketed DDP (handout 2.3.3(b)).

    s model bytes, w all-reduce algorithm bandwidth (bytes/s), o fixed cost of one all-reduce call (s),
    n_b buckets of s/n_b bytes each. Bucket i (i = 1..n_b) becomes ready at i·t, t = s/(n_b·w): computing
    a bucket's gradients takes as long as moving its bytes (the handout's assumption). The calls run one
    after another on the communication stream, each taking t + o, so the stream falls o further behind
    per bucket: call i ends at (i+1)·t + i·o. Backward ends at n_b·t, hence

        overhead(n_b) = t + n_b·o = s/(n_b·w) + n_b·o.

    n_b = 1 gives s/w + o, one whole all-reduce after backward (the flat variant). Fewer buckets expose
    more bandwidth time; more buckets pay more per-call cost. (Were o part of the per-bucket time that
    the compute matches too, only the last call would stick out, s/(n_b·w) + o, falling with n_b
    without an optimum: it is the per-call cost piling up on the stream that makes large buckets pay.)
    """
    if n_b <= 0 or w <= 0 or s < 0 or o < 0:
        raise ValueError(f"need n_b > 0, w > 0, s >= 0, o >= 0; got n_b={n_b}, w={w}, s={s}, o={o}")
    return s / (n_b * w) + n_b * o


def _check_cost(s: float, w: float, o: float) -> None:
    if s <= 0 or w <= 0 or o <= 0:
        raise ValueError(f"the optimum needs s > 0, w > 0 and a per-call cost o > 0; got s={s}, w={w}, o={o}")


def optimal_bucket_count(s: float, w: float, o: float) -> float:
    """d overhead / d n_b = -s/(n_b²·w) + o = 0  ⇒  n_b* = sqrt(s / (w·o))."""
    _check_cost(s, w, o)
    return math.sqrt(s / (w * o))


def optimal_bucket_bytes(s: float, w: float, o: float) -> float:
    """b* = s / n_b* = sqrt(s·w·o); the overhead there is 2·sqrt(s·o/w)."""
    _check_cost(s, w, o)
    return math.sqrt(s * w * o)


def minimal_ddp_overhead_s(s: float, w: float, o: float) -> float:
    """overhead(n_b*) = s/(n_b*·w) + n_b*·o = 2·sqrt(s·o/w)."""
    _check_cost(s, w, o)
    return 2 * math.sqrt(s * o / w)


def fit_allreduce_cost(nbytes: Sequence[float], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares fit of t = o + n/w to measured all-reduce times; returns (o seconds, w bytes/s).

    The D13 table gives (size, time) pairs; the intercept is the per-call cost and the inverse slope
    the algorithm bandwidth that the D17b model needs. A negative intercept (noisy small sizes) is
    returned as 0: the data then do not resolve a per-call cost.
    """
    if len(nbytes) != len(seconds) or len(nbytes) < 2:
        raise ValueError("need at least two (bytes, seconds) pairs of equal length")
    n = len(nbytes)
    mx, my = sum(nbytes) / n, sum(seconds) / n
    sxx = sum((x - mx) ** 2 for x in nbytes)
    if sxx == 0:
        raise ValueError("all-reduce sizes must differ to fit a bandwidth")
    slope = sum((x - mx) * (y - my) for x, y in zip(nbytes, seconds, strict=True)) / sxx
    if slope <= 0:
        raise ValueError("time does not grow with size; cannot fit a bandwidth")
    return max(my - slope * mx, 0.0), 1.0 / slope


# --------------------------------------------------------------------------------------------------
# D18: the XXL model (communication_accounting)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class XXL:
    """Handout 2.4's XXL: num_blocks blocks of two linears d_model→d_ff→d_model, nothing else.

    Assumptions (handout): fp32 master weights, fp32 accumulated gradients and the two fp32 AdamW moments
    = 16 bytes per parameter; bf16 activations, no checkpointing. Saved for backward per block and token:
    the input of each linear (its weight gradient needs it), d_model + d_ff bf16 values; there is no
    activation function whose input would also be kept.
    """

    d_model: int = 16384
    d_ff: int = 53248
    num_blocks: int = 126
    state_bytes_per_param: int = 4 + 4 + 2 * 4
    activation_bytes: int = BF16

    @property
    def params(self) -> int:
        return 2 * self.d_model * self.d_ff * self.num_blocks

    @property
    def state_bytes(self) -> int:
        """Master weights + gradients + AdamW moments: 16 · params."""
        return self.state_bytes_per_param * self.params

    @property
    def activation_bytes_per_token(self) -> int:
        """bf16 values saved for backward per token: (d_model + d_ff) · num_blocks · 2 bytes."""
        return (self.d_model + self.d_ff) * self.num_blocks * self.activation_bytes

    def activations(self, tokens: int) -> int:
        return tokens * self.activation_bytes_per_token

    def devices_to_hold(self, device_bytes: float = 80 * GB, tokens: int = 0) -> int:
        """(a) How many cards of ``device_bytes`` the unsharded state (+ activations of ``tokens``) fill."""
        return math.ceil((self.state_bytes + self.activations(tokens)) / device_bytes)

    def fsdp_bytes_per_device(self, n_fsdp: int, tokens: int = 0) -> float:
        """(b) State and half the activations sharded over N devices, the other half replicated:

        M(N) = (16·P + A/2) / N + A/2,   A = activation bytes of the batch.
        """
        a = self.activations(tokens)
        return (self.state_bytes + a / 2) / n_fsdp + a / 2

    def min_fsdp(self, device_bytes: float = 95 * GB, tokens: int = 0) -> int:
        """(b) Smallest N with M(N) < device_bytes: N > (16·P + A/2) / (device_bytes − A/2)."""
        a = self.activations(tokens)
        room = device_bytes - a / 2
        if room <= 0:
            raise ValueError(
                f"the replicated half of the activations ({a / 2 / GB:.1f} GB) alone exceeds the device"
            )
        return math.floor((self.state_bytes + a / 2) / room) + 1


@dataclass(frozen=True)
class ComputeBound:
    alpha: float  # C / W_ici: FLOPs per byte the links must carry to keep up
    batch_tokens: float  # smallest overall batch (tokens) that is compute bound
    per_device_tokens: float
    per_device_tokens_int: int
    batch_tokens_int: int


def fsdp_tp_compute_bound(
    d_ff: int = 53248,
    x: int = 16,
    y: int = 4,
    m_x: int = 2,
    m_y: int = 1,
    c: float = 4.6e14,
    w_ici: float = 2 * 9e10,
) -> ComputeBound:
    """(c) Forward pass of the XXL on a TPU v5p mesh, X-way FSDP × Y-way TP, N = X·Y chips (Scaling Book
    part 5, "FSDP + tensor parallelism"), batch B in tokens, per layer:

        T_math      = 2·2·B·D·F / (N·C)          (two matmuls, 2 FLOPs per multiply-add)
        T_FSDP comm = 2·2·D·F / (Y·W·M_X)        (all-gather the bf16 weight shards over X)
        T_TP comm   = 2·2·B·D / (X·W·M_Y)        (all-gather / reduce-scatter bf16 activations over Y)

    Communication overlaps compute, so we are compute bound while T_FSDP + T_TP <= T_math. Multiplying
    by N·C/(4·D·F), with α = C/W:  X·α/M_X + B·Y·α/(F·M_Y) <= B, i.e.

        B >= (X·α/M_X) / (1 − Y·α/(F·M_Y)),   per device B/N.

    (Requiring each communication alone to fit under the compute would give the weaker B >= X·α/M_X.)
    """
    alpha = c / w_ici
    tp_share = y * alpha / (d_ff * m_y)
    if tp_share >= 1:
        raise ValueError(f"tensor-parallel comms alone exceed compute (Y·α/(F·M_Y) = {tp_share:.2f} >= 1)")
    batch = (x * alpha / m_x) / (1 - tp_share)
    n = x * y
    per_device = batch / n
    per_device_int = math.ceil(per_device)
    return ComputeBound(alpha, batch, per_device, per_device_int, per_device_int * n)


# --------------------------------------------------------------------------------------------------
# D20: model memory and ZeRO-1 vs our sharded optimizer
# --------------------------------------------------------------------------------------------------


@cache
def parameter_numels(config: ModelConfig) -> tuple[int, ...]:
    """Element count of every parameter tensor, in ``model.parameters()`` order (meta device: free)."""
    return tuple(p.numel() for p in TransformerLM(config, device="meta").parameters())


def greedy_shards(numels: Sequence[int], world_size: int) -> list[int]:
    """Elements per rank when whole tensors go, largest first, to the least-loaded rank (ties: lowest
    rank): the ShardedOptimizer's own assignment. Whole tensors make the split slightly uneven."""
    loads = [0] * world_size
    assign_owners(numels, loads)
    return loads


@dataclass(frozen=True)
class ModelMemory:
    params: int
    grads: int
    optim_state: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optim_state

    def mib(self) -> dict[str, float]:
        return {
            "params_mib": self.params / MiB,
            "grads_mib": self.grads / MiB,
            "optim_state_mib": self.optim_state / MiB,
            "total_mib": self.total / MiB,
        }


def model_memory(
    config: ModelConfig,
    world_size: int = 1,
    sharded: bool = False,
    param_bytes: int = FP32,
    grad_bytes: int = FP32,
    states_per_param: int = 2,
    state_bytes: int = FP32,
) -> ModelMemory:
    """Bytes per rank of parameters, gradients and AdamW state (exp_avg, exp_avg_sq; the scalar step
    counters are ignored). Unsharded every rank holds all three in full; with optimizer-state sharding
    the state covers only the rank's shard: the largest greedy shard, ≈ 1/world_size of the elements."""
    numels = parameter_numels(config)
    total = sum(numels)
    owned = max(greedy_shards(numels, world_size)) if sharded else total
    return ModelMemory(total * param_bytes, total * grad_bytes, owned * states_per_param * state_bytes)


@dataclass(frozen=True)
class ShardingComm:
    """Bytes one rank sends per training step (ring algorithms: an all-reduce moves 2·(N−1)/N of the
    buffer, a reduce-scatter or an all-gather (N−1)/N, a broadcast of the shards (N−1)/N in total)."""

    ddp: float
    ours: float
    zero1: float


def sharding_communication(num_params: int, world_size: int, bytes_per_element: int = FP32) -> ShardingComm:
    """Per-rank communication volume per step, Φ = num_params · bytes:

    - plain DDP: all-reduce the gradients, 2·Φ·(N−1)/N;
    - ours: the same all-reduce (every rank gets every averaged gradient, though it only steps its own
      shard), then each owner broadcasts its updated parameters: + Φ·(N−1)/N, i.e. 3·Φ·(N−1)/N, 1.5×;
    - ZeRO-1 (P_os): reduce-scatter the gradients so each rank receives only its shard's sum,
      Φ·(N−1)/N, step, all-gather the parameters, Φ·(N−1)/N: 2·Φ·(N−1)/N, the same as plain DDP.
    """
    phi = num_params * bytes_per_element
    f = (world_size - 1) / world_size
    return ShardingComm(ddp=2 * phi * f, ours=3 * phi * f, zero1=2 * phi * f)
