"""Whose kernel ran: the judge's reading of a worker's provenance record (``worker/provenance.py``).

A Triton hook passes only when a Triton kernel defined in the graded repository's own files ran: one the
worker saw launched (eager calls, and the CPU interpreter) or, on a GPU, one whose name the profiler saw
(calls compiled by ``torch.compile``, which launch user kernels through inductor). Either hook fails when
torch's own attention ran (an SDPA operator, or a flash / memory-efficient / cuDNN attention kernel that
is not the repository's): the implementation must be the student's. The record comes from the graded
process; it is read as data and every file path in it is checked against the repository's roots here.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from ..exchange import Untrusted, text

# Substrings of torch's (and flash-attn's) attention operators and GPU kernels, as the profiler names them.
TORCH_ATTENTION = (
    "scaled_dot_product",
    "flash_attention",
    "efficient_attention",
    "cudnn_attention",
    "pytorch_flash",
    "fmha",
    "flash_fwd",
    "flash_bwd",
    "sdpa",
)


def inside(file: str, roots: list[Path]) -> bool:
    """A file of the graded repository: under one of its roots, and not in an environment inside it
    (a ``.venv`` in the repository holds torch's and Triton's own files)."""
    try:
        path = Path(file).resolve()
    except (OSError, ValueError):
        return False
    skip = {"site-packages", "dist-packages", ".venv", "venv", ".tox"}
    return any(path.is_relative_to(r) for r in roots) and not skip & set(path.parts)


def _names(record: Any, key: str) -> list:
    value = record.get(key) if isinstance(record, dict) else None
    if not isinstance(value, list | dict):
        raise Untrusted(f"the provenance record has no {key!r}")
    return value


def read(record: Any, roots: list[Path]) -> dict[str, Any]:
    """The record's facts, validated: the repository's kernels launched, the repository's kernel names,
    and every name the profiler saw."""
    launched = [x for x in _names(record, "launched") if isinstance(x, list) and len(x) == 2]
    kernels = _names(record, "repository_kernels")
    repo_kernels = (
        {str(n) for n, f in kernels.items() if inside(str(f), roots)} if isinstance(kernels, dict) else set()
    )
    return {
        "launched_repo": sorted({str(n) for n, f in launched if inside(str(f), roots)}),
        "launched_other": sorted({str(n) for n, f in launched if not inside(str(f), roots)}),
        "repo_kernels": repo_kernels,
        "operators": [str(n) for n in _names(record, "operators")],
        "kernels": [str(n) for n in _names(record, "kernels")],
    }


def is_torch_attention(name: str, repo_kernels: set[str]) -> bool:
    low = name.lower()
    return name not in repo_kernels and any(k in low for k in TORCH_ATTENTION)


# The forward must be the student's Triton (the handout's flash_forward); a backward in PyTorch is the
# course's own option, so only the forward is held to this: no borrowed compute (matmuls, softmax, torch's
# or inductor's attention) may take more of its GPU time than the repository's own kernels. Shares of all
# GPU time would not do at the course's shapes: there a 5 us kernel sits beside copies and casts that take
# longer (two real repositories' forwards spend 55% and 86% in such elementwise kernels, and pass).
BORROWED = re.compile(
    r"gemm|matmul|softmax|attention|attn|sdpa|flash|fmha|cudnn|cutlass|xmma|^triton_tem_", re.I
)


def _forward_share(record: Any, source_kernels: set[str]) -> list[str]:
    times = record.get("gpu_ms", {}).get("forward") if isinstance(record, dict) else None
    if not isinstance(times, dict) or not times:
        return []
    ms = {str(n): float(t) for n, t in times.items() if isinstance(t, int | float) and t >= 0}
    mine = sum(t for n, t in ms.items() if n in source_kernels)
    borrowed = {n: t for n, t in ms.items() if n not in source_kernels and BORROWED.search(n)}
    if sum(borrowed.values()) <= mine:
        return []
    shown = ", ".join(
        f"{text(n, 60)} ({t * 1e3:.0f} us)" for n, t in sorted(borrowed.items(), key=lambda kv: -kv[1])[:3]
    )
    return [
        f"the forward spends {sum(borrowed.values()) * 1e3:.0f} us in borrowed compute ({shown}) against "
        f"{mine * 1e3:.0f} us in this repository's own Triton kernels: the forward must be the student's"
    ]


def attention_misses(
    kind: str, record: Any, roots: list[Path], on_gpu: bool, source_kernels: set[str] | None = None
) -> list[str]:
    """Why the call's provenance fails (empty when it passes). ``source_kernels``: the Triton kernels
    the repository's source defines (``kernel_names``), by which a GPU call's forward is attributed."""
    facts = read(record, roots)
    kernels, repo = facts["kernels"], facts["repo_kernels"]
    foreign = sorted({n for n in facts["operators"] + kernels if is_torch_attention(n, repo)})
    misses = []
    if foreign:
        shown = ", ".join(text(n, 80) for n in foreign[:4])
        misses.append(f"torch's attention ran instead of the student's own: {shown}")
    if kind == "triton":
        ran = facts["launched_repo"] or (on_gpu and sorted(repo & set(kernels)))
        if not ran:
            others = facts["launched_other"] or kernels[:6]
            what = ", ".join(text(n, 80) for n in others) or "no Triton kernel at all, only torch operators"
            misses.append(f"no Triton kernel of this repository ran: the call ran {what}")
        elif on_gpu and source_kernels is not None:
            misses += _forward_share(record, source_kernels)
    return misses


def summary(record: Any, roots: list[Path]) -> dict[str, Any]:
    """What a bench row records of a timed call: the repository's kernels that ran, torch's attention
    that ran, and the GPU kernels the profiler named."""
    facts = read(record, roots)
    repo = facts["repo_kernels"]
    ran = sorted(set(facts["launched_repo"]) | (repo & set(facts["kernels"])))
    foreign = sorted({n for n in facts["operators"] + facts["kernels"] if is_torch_attention(n, repo)})
    return {"repository_kernels_ran": ran, "torch_attention_ran": foreign, "kernels": facts["kernels"][:40]}


def standing(record: Any, roots: list[Path], mean_ms: float | None, floor_ms: float | None) -> dict[str, Any]:
    """Whether a timed attention row may be ranked, and what its timed call ran: ``ranked`` is False, with
    ``unranked_because``, when no Triton kernel of the repository ran, when torch's attention did, or when
    the reported time is under ``floor_ms`` (the FLOPs at the GPU's dense peak: no kernel is faster). The
    time is the graded process's own report; these are the checks this process can make of it."""
    try:
        misses = attention_misses("triton", record, roots, on_gpu=True)
        ran = summary(record, roots)
    except Exception as exc:  # a malformed record is unranked, never a crash of the caller
        misses, ran = [f"no usable provenance record ({type(exc).__name__})"], {}
    if floor_ms is not None and mean_ms is not None and mean_ms < floor_ms:
        misses.append(
            f"reported {mean_ms:.3f} ms is below {floor_ms:.3f} ms, the GPU's dense peak for these FLOPs"
        )
    return {"ranked": not misses, "unranked_because": "; ".join(misses) or None, **ran}
