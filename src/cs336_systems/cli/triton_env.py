"""Imported first by ``python -m cs336_systems.cli.benchmark``: on a machine without CUDA, Triton
kernels (``--attention flash_triton``, ``--fused-loss``) run under Triton's interpreter, as tox runs
them. Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import), so it is set here,
before the CLI imports a kernel, unless the caller set it or Triton is already imported. Without it,
the two flags on a CPU ended in a 76-line traceback (issue 51).

``cli.train_8b`` does not import this: without CUDA it swaps in torch's pieces, in one line, unless
the caller sets the variable."""

from __future__ import annotations

import os
import sys


def interpret_triton_without_cuda() -> bool:
    """Set ``TRITON_INTERPRET=1`` when there is no CUDA and nothing decided it yet; True if set here."""
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return False
    import torch

    if torch.cuda.is_available():
        return False
    os.environ["TRITON_INTERPRET"] = "1"
    return True


SET_HERE = interpret_triton_without_cuda()
