"""Imported by ``python -m cs336_systems.cli.benchmark`` before any kernel: on a machine without CUDA, Triton
kernels (``--attention flash_triton``, ``--fused-loss``) run under Triton's interpreter, as tox runs
them. Triton reads ``TRITON_INTERPRET`` when a kernel is decorated (at import), so it is set here,
before the CLI imports a kernel, unless the caller set it or Triton is already imported (without it,
the two flags end in a traceback on a CPU).

``cli.train_8b`` does not import this: without CUDA it swaps in torch's pieces, in one line, unless
the caller sets the variable.

    python -m cs336_systems.cli.triton_env      # says how Triton kernels run on this machine"""

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


# Imported (by ``cli.benchmark``): decided now, before any kernel import. Run as a command: decided in
# ``main``, after its arguments (``--help`` needs no torch).
SET_HERE = interpret_triton_without_cuda() if __name__ != "__main__" else False


def main(argv: list[str] | None = None) -> int:
    from cs336_systems.cli.common import Parser

    Parser("triton_env", description=__doc__).parse_args(argv)
    set_here = SET_HERE or interpret_triton_without_cuda()
    value = os.environ.get("TRITON_INTERPRET")
    if set_here:
        print("TRITON_INTERPRET=1 (set here: no CUDA): Triton kernels run under Triton's interpreter, slowly")
    elif value is not None:
        print(f"TRITON_INTERPRET={value} (set before): as the caller set it")
    else:
        print("TRITON_INTERPRET unset: Triton kernels compile for the GPU")
    return 0


if __name__ == "__main__":
    sys.exit(main())
