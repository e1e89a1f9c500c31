"""The dtypes by the names the case table and the workers' arguments give them, for both sides of the
process boundary: one map, so that a name means one torch dtype in the judge, the workers and the
parent's clock alike. (``worker/fsdp.py`` keeps its own on purpose: there fp32 means no compute dtype,
``None``, not ``torch.float32``.) This module imports only torch.
"""

from __future__ import annotations

import torch

DTYPES: dict[str, torch.dtype] = {
    "fp16": torch.float16,
    "bf16": torch.bfloat16,
    "fp32": torch.float32,
    "fp64": torch.float64,
}
