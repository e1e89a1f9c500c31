"""torch.profiler kernel summaries per NVTX/profiler range, and the D3 (nsys_profile) answers as data.

``nsys`` is not usable on the GPU machines, so the handout's "CUDA GPU Kernel Summary filtered by NVTX
range" is rebuilt from torch.profiler: every kernel is attributed to the ranges that were open on the
host when it was launched (the launching op's start time lies inside the range). That works across
threads, which matters because autograd runs backward ops on its own thread, outside the Python call
stack of the "backward" range. On the CPU there are no kernels; the summary then uses each aten op's
self CPU time, so the same code (and the tests) run everywhere.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import torch

from cs336_systems.nvtx import annotate
from cs336_systems.profiling.flops import ForwardFlops
from cs336_systems.profiling.timing import synchronize

STEP_RANGE = "profiled step"
# Ranges set by the workload (forward/loss/backward/optimizer step), the model's blocks (attn/ffn) and
# the annotated reference attention (its three stages).
RANGES = (
    STEP_RANGE,
    "forward",
    "loss",
    "backward",
    "optimizer step",
    "attn",
    "ffn",
    "scaled dot product attention",
    "computing attention scores",
    "computing softmax",
    "final matmul",
)
# cuBLAS (sgemm / xmma / nvjet on Hopper / cutlass), split-K reductions, Inductor's matmul templates;
# on the CPU the aten matmul ops. Fused attention kernels are their own category (checked first).
_ATTENTION_KERNEL = re.compile(r"flash|fmha|attention|efficient_attention", re.IGNORECASE)
_MATMUL_KERNEL = re.compile(
    r"gemm|gemv|nvjet|xmma|wgmma|cutlass|cublas|splitkreduce|triton_tem_|"
    r"^aten::(mm|bmm|addmm|baddbmm|addbmm|_scaled_mm)$",
    re.IGNORECASE,
)


def kernel_category(name: str) -> str:
    if _ATTENTION_KERNEL.search(name):
        return "attention"
    if _MATMUL_KERNEL.search(name):
        return "matmul"
    return "other"


@dataclass
class ProfileSummary:
    """Kernel launches of ``steps`` profiled steps, each tagged with the ranges it ran under.

    ``launches`` has one row per kernel launch (CPU: per aten op) with columns ``kernel``,
    ``duration_us``, ``category`` and one boolean column per range in RANGES. ``wall_ms`` is the mean
    host-side duration of each range per step.
    """

    launches: pd.DataFrame
    steps: int
    device_type: str
    wall_ms: dict[str, float]

    def _rows(self, ranges: str | Iterable[str]) -> pd.DataFrame:
        names = [ranges] if isinstance(ranges, str) else list(ranges)
        unknown = [r for r in names if r not in RANGES]
        if unknown:
            raise ValueError(f"unknown ranges {unknown}; known: {RANGES}")
        mask = self.launches[names].any(axis=1)
        return self.launches[mask]

    def kernel_ms(self, ranges: str | Iterable[str] = STEP_RANGE) -> float:
        """Summed kernel time per step inside the range(s), in ms."""
        return float(self._rows(ranges)["duration_us"].sum()) / 1e3 / self.steps

    def top_kernels(self, ranges: str | Iterable[str] = STEP_RANGE, n: int | None = 10) -> pd.DataFrame:
        """Kernels by total time inside the range(s): calls and ms per step, share of the range's time."""
        rows = self._rows(ranges)
        table = rows.groupby("kernel", sort=False).agg(
            calls=("duration_us", "size"), total_us=("duration_us", "sum"), category=("category", "first")
        )
        total = table["total_us"].sum()
        table = table.assign(
            calls_per_step=table["calls"] / self.steps,
            ms_per_step=table["total_us"] / 1e3 / self.steps,
            share=table["total_us"] / total if total else 0.0,
        ).sort_values("total_us", ascending=False)
        table = table[["category", "calls_per_step", "ms_per_step", "share"]].reset_index()
        return table if n is None else table.head(n)

    def category_share(self, ranges: str | Iterable[str] = STEP_RANGE, category: str = "matmul") -> float:
        rows = self._rows(ranges)
        total = rows["duration_us"].sum()
        return float(rows.loc[rows["category"] == category, "duration_us"].sum() / total) if total else 0.0

    def range_table(self) -> pd.DataFrame:
        """Per range present: kernel ms and launches per step, matmul share, host wall ms per step."""
        rows = []
        for name in RANGES:
            sub = self.launches[self.launches[name]]
            if sub.empty and name not in self.wall_ms:
                continue
            total = sub["duration_us"].sum()
            rows.append(
                {
                    "range": name,
                    "kernel_ms": total / 1e3 / self.steps,
                    "launches": len(sub) / self.steps,
                    "matmul_share": sub.loc[sub["category"] == "matmul", "duration_us"].sum() / total
                    if total
                    else 0.0,
                    "wall_ms": self.wall_ms.get(name, float("nan")),
                }
            )
        return pd.DataFrame(rows)

    def d3_answers(self, flops: ForwardFlops | None = None) -> dict[str, Any]:
        """The handout's nsys_profile questions (a)-(e) as numbers (per step = per forward)."""
        out: dict[str, Any] = {
            "profile_device": self.device_type,
            "profiled_steps": self.steps,
            # (a) forward time from the profiler, to compare with the timed forward
            "forward_kernel_ms": self.kernel_ms("forward"),
            "forward_wall_ms": self.wall_ms.get("forward", float("nan")),
            "step_kernel_ms": self.kernel_ms(STEP_RANGE),
        }
        # (b) top kernel of the forward and of forward+backward, with calls per step
        for key, ranges in (("forward", ["forward"]), ("fwd_bwd", ["forward", "loss", "backward"])):
            top = self.top_kernels(ranges, n=1)
            if not top.empty:
                out[f"{key}_top_kernel"] = top.loc[0, "kernel"]
                out[f"{key}_top_kernel_calls"] = float(top.loc[0, "calls_per_step"])
                out[f"{key}_top_kernel_share"] = float(top.loc[0, "share"])
        if "forward_top_kernel" in out and "fwd_bwd_top_kernel" in out:
            out["same_top_kernel"] = out["forward_top_kernel"] == out["fwd_bwd_top_kernel"]
        # (c) the largest non-matmul kernels of the forward
        others = self.top_kernels("forward", n=None)
        others = others[others["category"] != "matmul"].head(3)
        out["forward_top_other_kernels"] = [
            f"{row.kernel} ({row.share:.1%})" for row in others.itertuples(index=False)
        ]
        # (d) matmul share: forward vs the whole step (train step includes backward and AdamW)
        out["matmul_share_forward"] = self.category_share("forward")
        out["matmul_share_step"] = self.category_share(STEP_RANGE)
        if self.launches["backward"].any():
            out["matmul_share_backward"] = self.category_share("backward")
        if self.launches["optimizer step"].any():
            out["optimizer_ms"] = self.kernel_ms("optimizer step")
        # (e) inside attention (forward only): softmax vs the two matmuls, with their FLOPs
        stages = {
            "scores": "computing attention scores",
            "softmax": "computing softmax",
            "final_matmul": "final matmul",
        }
        fwd = self.launches["forward"]
        for key, name in stages.items():
            out[f"attn_{key}_ms"] = float(
                self.launches.loc[fwd & self.launches[name], "duration_us"].sum()
            ) / (1e3 * self.steps)
        if flops is not None:
            out["attn_scores_flops"] = flops.attn_scores
            out["attn_softmax_flops"] = flops.attn_softmax
            out["attn_final_matmul_flops"] = flops.attn_values
        return out


def _intervals(events: Iterable[Any]) -> dict[str, list[tuple[float, float]]]:
    spans: dict[str, list[tuple[float, float]]] = {name: [] for name in RANGES}
    for e in events:
        if e.name in spans and _is_cpu(e):
            spans[e.name].append((e.time_range.start, e.time_range.end))
    for name in spans:
        spans[name].sort()
    return spans


def _inside(spans: list[tuple[float, float]], starts: list[float], t: float) -> bool:
    i = bisect.bisect_right(starts, t) - 1
    # Ranges of one name do not overlap in a step, so only the last one starting before t can hold t.
    return i >= 0 and spans[i][0] <= t <= spans[i][1]


def _is_cpu(event: Any) -> bool:
    return event.device_type == torch.autograd.DeviceType.CPU


def _launches(events: Iterable[Any], device_type: str) -> list[tuple[str, float, float]]:
    """(kernel name, duration us, host launch time) per kernel; CPU: per aten op, self time."""
    out = []
    for e in events:
        if not _is_cpu(e):
            continue
        if device_type == "cuda":
            # Kernels hang off the host op that launched them (torch links them by correlation id).
            out += [(k.name, float(k.duration), e.time_range.start) for k in e.kernels]
        elif e.name.startswith("aten::") and e.self_cpu_time_total > 0:
            out.append((e.name, float(e.self_cpu_time_total), e.time_range.start))
    return out


def summarize(events: Iterable[Any], steps: int, device_type: str) -> ProfileSummary:
    events = list(events)
    spans = _intervals(events)
    starts = {name: [s for s, _ in v] for name, v in spans.items()}
    records = []
    for kernel, duration, t in _launches(events, device_type):
        tags = {name: _inside(spans[name], starts[name], t) for name in RANGES}
        if tags[STEP_RANGE]:
            records.append({"kernel": kernel, "duration_us": duration, **tags})
    columns = ["kernel", "duration_us", *RANGES]
    launches = pd.DataFrame(records, columns=columns)
    launches[list(RANGES)] = launches[list(RANGES)].astype(bool)
    launches["category"] = launches["kernel"].map(kernel_category)
    wall = {name: sum(end - start for start, end in v) / 1e3 / steps for name, v in spans.items() if v}
    return ProfileSummary(launches=launches, steps=steps, device_type=device_type, wall_ms=wall)


def profile_step(
    step: Callable[[], Any],
    device: torch.device | str,
    *,
    steps: int = 1,
    warmup: int = 1,
    trace_path: str | Path | None = None,
) -> ProfileSummary:
    """Run ``warmup`` untimed steps, then profile ``steps`` steps (each in a "profiled step" range,
    synchronized so every kernel lands in the trace). ``trace_path`` (``.json`` or ``.json.gz``) gets
    the Chrome trace, for chrome://tracing or ui.perfetto.dev."""
    device = torch.device(device)
    if steps < 1:
        raise ValueError(f"need at least one profiled step, got {steps}")
    for _ in range(warmup):
        step()
    synchronize(device)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(steps):
            with annotate(STEP_RANGE):
                step()
            synchronize(device)
    if trace_path is not None:
        Path(trace_path).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(trace_path))
    return summarize(prof.events(), steps, device.type)
