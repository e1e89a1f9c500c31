"""The one factory of the DDP family: ``make_ddp(variant, module, bucket_size_mb)`` builds the wrapper
named ``variant``. Used by the training-step harness and the equivalence tests alike.

It lives apart from ``ddp.py`` because it imports every subclass, and every subclass imports the base
class there: with the factory in the base module the two would import each other
(``tests/test_layout.py`` checks that no import cycle remains).
"""

from __future__ import annotations

import torch.nn as nn

from cs336_systems.distributed.ddp import DataParallel
from cs336_systems.distributed.ddp_bucketed import DDPBucketed
from cs336_systems.distributed.ddp_individual import DDPIndividualParameters
from cs336_systems.distributed.naive_ddp import NaiveDDP

VARIANTS = ("naive", "flat", "individual", "bucketed")


def make_ddp(variant: str, module: nn.Module, bucket_size_mb: float | None = None) -> DataParallel:
    """The wrapper named ``variant``: naive (D14), flat (D15), individual (D16), bucketed (D17).
    ``bucket_size_mb`` (MiB, ``units.mb_to_bytes``) is required for bucketed and only for it."""
    if variant not in VARIANTS:
        raise ValueError(f"unknown DDP variant {variant!r}; choose one of {VARIANTS}")
    if (variant == "bucketed") != (bucket_size_mb is not None):
        raise ValueError(f"bucket_size_mb is required for 'bucketed' and only for it, got {bucket_size_mb}")
    if variant in ("naive", "flat"):
        return NaiveDDP(module, flat=variant == "flat")
    if variant == "individual":
        return DDPIndividualParameters(module)
    return DDPBucketed(module, bucket_size_mb=bucket_size_mb)


__all__ = ["VARIANTS", "make_ddp"]
