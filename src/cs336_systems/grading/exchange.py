"""Reading what a graded process wrote: untrusted data, validated before any use.

Each output file was asked for by name (``<case>.rank<r>.pt`` in a folder this process made) and is
read with ``torch.load(weights_only=True)`` (tensors and plain containers, no code). It must carry the
run's token (so it came from the run that was started, not from an earlier one or a file shipped in a
repository), its own case name and rank; every tensor the judge uses is checked for presence, type,
shape, dtype and finiteness first. Anything else raises :class:`Untrusted`, which fails the case with
what was wrong: a malformed output is never a pass.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

MAX_BYTES = 4 << 30  # far above any case's record: a bound on what a worker can make the judge load


class Untrusted(Exception):
    """An output that is missing, malformed or not from this run; the message says which and how."""


def read_payload(path: Path, token: str, name: str, rank: int, max_bytes: int = MAX_BYTES) -> dict[str, Any]:
    """The record ``path`` holds, when it is this run's (``token``) record of case ``name`` at ``rank``
    and no larger than ``max_bytes`` (a worker must not make the judge load an unbounded file)."""
    if not path.is_file():
        raise Untrusted(f"no output {path.name}")
    size = path.stat().st_size
    if size > max_bytes:
        raise Untrusted(f"{path.name} is {size} bytes, more than any case writes ({max_bytes})")
    import torch  # here: the class run's report reads ``text`` alone, without torch's 1.7 s import

    try:
        body = torch.load(path, weights_only=True, map_location="cpu")
    except Exception as exc:  # a file that is not a weights-only torch archive
        raise Untrusted(
            f"{path.name} does not load as plain tensors and data: {type(exc).__name__}"
        ) from None
    if not isinstance(body, dict):
        raise Untrusted(f"{path.name} holds a {type(body).__name__}, not the output record")
    if body.get("token") != token:
        raise Untrusted(
            f"{path.name} does not carry this run's token: not written by the run the grader started"
        )
    if body.get("case") != name or body.get("rank") != rank:
        raise Untrusted(f"{path.name} claims case {body.get('case')!r} rank {body.get('rank')!r}")
    return body


def field(obj: Any, key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise Untrusted(f"{where}: no {key!r} in the output")
    value = obj[key]
    if not isinstance(value, kind):
        raise Untrusted(f"{where}: {key!r} is a {type(value).__name__}")
    return value


def tensor(
    value: Any,
    name: str,
    shape: tuple[int, ...] | None = None,
    dtype: torch.dtype | None = None,
    finite: bool = True,
) -> torch.Tensor:
    """``value`` as a tensor of ``shape`` and ``dtype``, with no NaN or inf (when ``finite``)."""
    import torch

    if not isinstance(value, torch.Tensor):
        raise Untrusted(
            f"{name} is {'missing' if value is None else 'a ' + type(value).__name__}, not a tensor"
        )
    if value.layout != torch.strided or value.is_quantized:
        raise Untrusted(f"{name} is not a plain dense tensor")
    if shape is not None and tuple(value.shape) != tuple(shape):
        raise Untrusted(f"{name} has shape {tuple(value.shape)}, expected {tuple(shape)}")
    if dtype is not None and value.dtype != dtype:
        raise Untrusted(f"{name} is {value.dtype}, expected {dtype}")
    if finite and value.is_floating_point() and not bool(torch.isfinite(value).all()):
        bad = int((~torch.isfinite(value)).sum())
        raise Untrusted(f"{name} has {bad} non-finite values (NaN or inf)")
    return value


def tensors(value: Any, name: str, shapes: list[tuple[int, ...]], allow_none: bool = False) -> list:
    if not isinstance(value, list) or len(value) != len(shapes):
        got = len(value) if isinstance(value, list) else type(value).__name__
        raise Untrusted(f"{name}: expected a list of {len(shapes)} tensors, got {got}")
    return [
        None if (v is None and allow_none) else tensor(v, f"{name}[{i}]", s)
        for i, (v, s) in enumerate(zip(value, shapes, strict=True))
    ]


def text(value: Any, limit: int = 600) -> str:
    """Text from the graded process, for display only: printable, one bounded paragraph."""
    s = value if isinstance(value, str) else repr(value)
    s = "".join(ch if ch.isprintable() or ch == "\n" else "?" for ch in s)
    return s[:limit]
