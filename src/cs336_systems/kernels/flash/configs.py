"""Tile configs as data: the candidates each kernel is tuned over, per case class, and the tuning keys.

The lists come from the H100 sweeps (docs/notes/attention-kernels.md, docs/perf-notes.md); each entry
that is not the first is there because a measured case chose it. What never won left the lists: the
Triton and non-specialized Gluon one-pass backwards (dQ added atomically from the dK/dV pass; both slower
at long sequences) and the 90-config "wide" sweep (its winners are the entries here). The
warp-specialized one-pass backward is a dK/dV candidate (``one_pass``): a dK/dV key's candidates are
timed as whole backwards, so choosing it is choosing the backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import triton

from .settings import INTERPRET

KERNELS = ("fwd", "dq", "dkdv")


@dataclass(frozen=True)
class TileConfig:
    q_tile: int
    k_tile: int
    num_warps: int = 4
    num_stages: int = 2
    tma: bool = False  # tensor descriptors (Hopper's copy engine) instead of block pointers
    # The Gluon (Hopper) kernel where it can run, else the Triton one with the same tiles (and TMA). For
    # the forward and dQ, num_stages is the depth of its K/V ring.
    gluon: bool = False
    # With gluon: the warp-specialized Gluon pass (a producer warp and two consumer warp groups of 64 rows:
    # query rows for the forward and dQ, whose q_tile is 128; keys for dK/dV, whose k_tile is 128).
    # num_stages is the depth of its tile ring.
    ws: bool = False
    # dK/dV with ws: the one-pass backward (``gluon_ws_one_pass``), whose dK/dV pass also adds dQ, so no dQ
    # pass runs; where it cannot run, its split twin (the same config without one_pass) does.
    one_pass: bool = False

    def __str__(self) -> str:
        tma, gluon, ws = "-tma" if self.tma else "", "-gluon" if self.gluon else "", "-ws" if self.ws else ""
        one_pass = "-1pass" if self.one_pass else ""
        return f"q{self.q_tile}-k{self.k_tile}-w{self.num_warps}-s{self.num_stages}{tma}{gluon}{ws}{one_pass}"


def gpu_candidates(kernel: str, d: int, dtype: torch.dtype) -> list[TileConfig]:
    """The short lists tuning uses on a GPU, best first (the default when tuning is off), per (kernel,
    4-byte dtype?, d > 64?). Constraints: forward and dQ need q_tile % k_tile == 0, dK/dV k_tile % q_tile
    == 0 (diagonal tiles line up with the loop steps). A "-tma" config runs with block pointers where
    strides rule descriptors out."""
    C = TileConfig
    wide = dtype == torch.float32  # 4-byte elements: twice the shared memory and registers per tile
    big_d = d > 64
    T = True  # tensor descriptors

    def G(q: int, k: int, w: int, s: int = 2) -> TileConfig:  # Gluon (Triton's q-k-w-s-tma elsewhere)
        return C(q, k, w, s, T, gluon=True)

    # The warp-specialized Gluon passes (measured: docs/perf-notes.md, FlashAttention-2, "Warp-specialized
    # passes" and "Figures moved out of docstrings"):
    # - dK/dV: faster than G(64, 128, 8) at d = 128 on (1, 32, 32768), (2, 32, 4096) causal and at
    #   (1, 4, 1024), which it replaced;
    # - forward: faster than the best listed forward at (1, 32, 32768, 128) causal, in the model's layout
    #   too, at (2, 32, 4096), and at d = 64 on (1, 16, 16384) causal and (2, 16, 8192); 3 stages, as 2 lose;
    # - dQ: faster than the best listed dQ at d = 128 on (2, 32, 4096) causal, (4, 16, 1024), (32, 8, 512);
    #   3 stages, as 2 lose; at d = 64 it lost, and 128-key tiles spill at d = 128.
    WS = C(64, 128, 4, 2, T, gluon=True, ws=True)
    WS_FWD = C(128, 128, 4, 3, T, gluon=True, ws=True)
    WS_DQ = C(128, 64, 4, 3, T, gluon=True, ws=True)
    # - one pass: the whole backward faster than the split one at (1, 32, 32768, 128) causal; at
    #   (2, 32, 4096, 128), and at d = 64 on (1, 16, 16384) (the leaderboard case), faster when timed
    #   sustained but slower in short bursts: listed at both head dims; keys are timed sustained
    #   (tuner.sustained_time_ms). Measured: docs/perf-notes.md, FlashAttention-2, "Warp-specialized
    #   one-pass backward" and "Figures moved out of docstrings".
    ONE_PASS = replace(WS, one_pass=True)

    return {
        ("fwd", False, False): [
            C(64, 64, 4, 4, T),
            C(128, 64, 8, 3, T),
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3),
            # Gluon, S_j issued with P_{j-1} V_{j-1}: chosen for non-causal (2, 16, 8192), (1, 1, 16384)
            # and (32, 16, 128) by the H100 grid's tuning; at d = 128 it lost everywhere.
            G(64, 64, 4, 3),
            WS_FWD,
        ],
        ("fwd", False, True): [
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 64, 4, 4, T),
            C(128, 32, 4, 3, T),
            C(128, 128, 8, 3, T),  # (2, 32, 4096) and 32k causal (the H100 grid's tuning)
            WS_FWD,
        ],
        ("fwd", True, False): [C(128, 32, 8, 3, T), C(128, 64, 8, 2, T), C(64, 32, 4, 3, T)],
        ("fwd", True, True): [C(128, 32, 8, 2, T), C(128, 32, 8, 2), C(64, 32, 4, 2)],
        ("dkdv", False, False): [
            C(64, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(32, 64, 4, 3, T),
            C(32, 128, 4, 3, T),
            # Gluon, S^T/dP^T issued together and the exponentials under dP^T: faster than the Triton dK/dV
            # at (1, 16, 16384); chosen on every long grid shape (docs/perf-notes.md, "Gluon passes").
            G(64, 64, 4),
            G(32, 64, 4),
            WS,  # not yet measured at d = 64
            ONE_PASS,
        ],
        ("dkdv", False, True): [
            C(32, 64, 4, 3, T),
            C(64, 128, 8, 2, T),
            C(32, 64, 4, 4, T),
            C(32, 128, 4, 3, T),  # the Triton tutorial's dK/dV tiles
            C(64, 128, 8, 3, T),  # 32k causal: a faster backward than with q32-k64-w4-s3 (issue 17)
            C(64, 64, 4, 2, T),  # (4, 16, 1024) causal (the H100 grid's tuning)
            G(64, 64, 4),  # 32k causal: faster than the Triton dK/dV (docs/perf-notes.md, "Gluon passes")
            WS,
            ONE_PASS,
        ],
        ("dkdv", True, False): [C(32, 128, 8, 2, T), C(32, 64, 4, 2, T), C(32, 128, 8, 3, T)],
        ("dkdv", True, True): [C(32, 32, 4, 2), C(16, 64, 4, 2, T), C(32, 32, 4, 2, T)],
        ("dq", False, False): [
            C(128, 64, 4, 4, T),
            C(64, 64, 4, 3, T),
            C(128, 64, 8, 3, T),
            C(64, 32, 4, 3, T),
            # Gluon, S_j and dP_j issued with dS_{j-1} K_{j-1}: faster than the best Triton dQ at
            # (1, 2, 16384), chosen at (4, 25, 512) and (256, 1, 512) too; at d = 128 it lost everywhere.
            G(64, 64, 4, 3),
        ],
        ("dq", False, True): [
            C(64, 32, 4, 3, T),
            C(128, 64, 8, 2, T),
            C(64, 64, 4, 3, T),
            C(64, 32, 4, 4, T),
            C(128, 32, 4, 3, T),  # the Triton tutorial's dQ tiles
            C(128, 64, 8, 3, T),  # 32k causal: a faster backward than with q128-k32-w4-s3 (issue 17)
            WS_DQ,
        ],
        ("dq", True, False): [C(128, 32, 8, 2, T), C(64, 32, 4, 2, T), C(128, 32, 8, 3, T)],
        ("dq", True, True): [C(64, 16, 4, 2), C(64, 16, 4, 2, T), C(32, 32, 4, 2)],
    }[kernel, wide, big_d]


def gpu_candidate_configs(kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates of ``kernel`` for head dim ``d`` on a GPU: the short list plus the block-pointer
    twin of its first entry (for short sequences, building descriptors on the host costs more than TMA
    saves)."""
    listed = gpu_candidates(kernel, triton.next_power_of_2(d), dtype)
    twin = replace(listed[0], tma=False)
    return tuple(listed) if twin in listed else (*listed, twin)


@functools.cache
def candidate_configs(kernel: str, d: int, dtype: torch.dtype) -> tuple[TileConfig, ...]:
    """The candidates of ``kernel`` for head dim ``d``: :func:`gpu_candidate_configs`, or under the
    interpreter small tiles, so that the tiny CPU test shapes span several tiles and loop phases."""
    if INTERPRET:
        return (TileConfig(16, 32),) if kernel == "dkdv" else (TileConfig(32, 16),)
    return gpu_candidate_configs(kernel, d, dtype)


def bucket(n: int) -> int:
    """The next power of two."""
    return 1 << max(n - 1, 0).bit_length()


def tune_key(name: str, bh: int, n_q: int, n_k: int, d: int, causal: bool, dtype: torch.dtype) -> tuple:
    """Sequence lengths are bucketed to powers of two (ragged lengths share their bucket's choice) and so
    is batch x heads up to 64: with few heads the grid is short, and smaller tiles fill more SMs."""
    return (name, min(bucket(bh), 64), bucket(n_q), bucket(n_k), d, causal, dtype)


def key_str(key: tuple) -> str:
    name, bh, n_q, n_k, d, causal, dtype = key
    causal_s = "causal" if causal else "full"
    return f"{name}|bh{bh}|q{n_q}|k{n_k}|d{d}|{causal_s}|{str(dtype).removeprefix('torch.')}"


def parse_key(text: str) -> tuple:
    """:func:`key_str`'s inverse (the disk cache's keys)."""
    dtypes = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16)}
    name, bh, n_q, n_k, d, causal, dtype = text.split("|")
    return (name, int(bh[2:]), int(n_q[1:]), int(n_k[1:]), int(d[1:]), causal == "causal", dtypes[dtype])
