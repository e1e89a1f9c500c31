"""Entry points: ``python -m cs336_systems.cli.benchmark`` (handout 1.1.3) and
``python -m cs336_systems.cli.report`` (benchmark JSON -> writeup; also ``python -m cs336_systems.report``).

On a machine without CUDA the entry points run the Triton kernels under Triton's interpreter, as tox
does: Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import), so it is set here,
before any entry point imports a kernel, unless the caller set it or Triton is already imported.
Without it, ``--attention flash_triton`` or ``--fused-loss`` on a CPU ended in a long traceback."""

from __future__ import annotations

import os
import sys


def _interpret_triton_without_cuda() -> None:
    if "TRITON_INTERPRET" in os.environ or "triton" in sys.modules:
        return
    try:
        import torch
    except ImportError:  # the report's entry point runs without torch
        return
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


_interpret_triton_without_cuda()
