"""The grading knobs read from the environment (every ``CS336_*`` variable lives in a settings module).

- ``CS336_ADAPTERS``: the adapters file to grade, as ``--adapters`` (the option wins).
- ``CS336_GRADE_PROBE``: set by the run itself: the controller's probe of the adapters file, handed to
  its pytest-xdist workers so that each does not load the file again.
"""

from __future__ import annotations

import json
import os

ADAPTERS_ENV = "CS336_ADAPTERS"
PROBE_ENV = "CS336_GRADE_PROBE"


def adapters_from_env() -> str | None:
    return os.environ.get("CS336_ADAPTERS") or None


def cached_probe(adapters: str) -> dict | None:
    """The probe of ``adapters`` made by this run's controller, if any."""
    cached = json.loads(os.environ.get("CS336_GRADE_PROBE", "{}"))
    return cached["probe"] if cached.get("adapters") == adapters else None


def cache_probe(adapters: str, probe: dict) -> None:
    os.environ["CS336_GRADE_PROBE"] = json.dumps({"adapters": adapters, "probe": probe})
