"""The worker's one environment knob: ``CS336_GRADE_OUT``, the file its result goes to (set by the runner)."""

from __future__ import annotations

import os
from pathlib import Path

OUT_ENV = "CS336_GRADE_OUT"


def out_path() -> Path:
    return Path(os.environ["CS336_GRADE_OUT"])
