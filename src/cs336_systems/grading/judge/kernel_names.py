"""The Triton kernels a repository defines, read from its source files without importing them.

A function counts when a decorator names Triton's ``jit`` (``@triton.jit``, ``@tl.jit``, ``@jit`` imported
from triton, with or without arguments), possibly under ``@triton.autotune`` / ``@triton.heuristics``.
Triton names a compiled kernel after its Python function, so these are the names an observer outside
the process sees for the repository's own kernels. Names inductor gives its generated kernels
(``triton_poi_...``, ``triton_tem_...``) never count, whatever a repository calls a function: a
``flex_attention`` template compiled by torch would otherwise pass as the student's.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

from ..roots import SKIP_DIRS

# An attention kernel the repository did not write: torch's SDPA backends (flash, memory-efficient,
# cuDNN), flash-attn, xformers, and inductor's compiled ``flex_attention`` (its templates name the op).
LIBRARY_ATTENTION = re.compile(r"attention|attn|sdpa|fmha|flash|cudnn|flex|xformers", re.I)
GEMM = re.compile(r"gemm|xmma|cutlass|nvjet|cublas|matmul", re.I)  # cuBLAS's and CUTLASS's matmuls
OWN, LIBRARY, INDUCTOR_KIND, GEMM_KIND, OTHER = (
    "own Triton",
    "library attention",
    "inductor",
    "GEMMs",
    "other",
)
INDUCTOR = re.compile(r"^triton_(poi|red|per|tem|mm|bmm|for|spl|tma|helper)_|^triton_\d")


def _names_jit(decorator: ast.expr) -> bool:
    target = decorator.func if isinstance(decorator, ast.Call) else decorator
    if isinstance(target, ast.Attribute):
        return target.attr == "jit"
    return isinstance(target, ast.Name) and target.id == "jit"


def kernels_in(source: str) -> set[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return set()
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and any(_names_jit(d) for d in node.decorator_list)
        and not INDUCTOR.match(node.name)
    }


def repository_kernels(folders: list[Path], limit_files: int = 5000) -> set[str]:
    """Every Triton kernel name defined in the Python files under ``folders`` (environments skipped)."""
    found: set[str] = set()
    seen = 0
    for root in dict.fromkeys(Path(f).resolve() for f in folders):
        for folder, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
            for name in files:
                if not name.endswith(".py") or seen >= limit_files:
                    continue
                seen += 1
                try:
                    found |= kernels_in((Path(folder) / name).read_text(errors="replace"))
                except OSError:
                    continue
    return found


def kind(name: str, repo_kernels: set[str]) -> str:
    """What a kernel the observer saw is: the repository's own Triton, a library's attention, inductor's
    code (compiled from PyTorch), a library matmul, or anything else (elementwise, copies, reductions)."""
    if name in repo_kernels:
        return OWN
    if LIBRARY_ATTENTION.search(name):
        return LIBRARY
    if INDUCTOR.match(name):
        return INDUCTOR_KIND
    return GEMM_KIND if GEMM.search(name) else OTHER


def by_kind(times: dict[str, float], repo_kernels: set[str]) -> dict[str, float]:
    """GPU time (ms) per kind of kernel."""
    found: dict[str, float] = {}
    for name, ms in times.items():
        found[kind(name, repo_kernels)] = found.get(kind(name, repo_kernels), 0.0) + ms
    return found
