"""The grading knobs read from the environment (every ``CS336_*`` variable lives in a settings module).

- ``CS336_ADAPTERS``: the adapters file to grade, as ``--adapters`` (the option wins).
- ``CS336_GRADE_LOADED``, ``CS336_GRADE_SEED``: set by the run itself, so that its pytest-xdist workers
  neither load the adapters file again nor draw another seed (and by a class run's ``repo_job``, whose
  jobs each load the file anyway). Workers of the graded code never see them.
- ``CS336_GRADE_HIDE``: set by a class run for each repository's job: the class's other repositories
  (``os.pathsep``-separated), which its workers do not see at all (``sandbox``).
- ``CS336_GRADE_SCRATCH``: set by ``repo_job`` for everything of one repository that runs its code (the
  judge's workers, the course tests, the leaderboard): that repository's ``HOME`` and compile caches.
- ``CS336_GRADE_WORKER_USER``: set by ``repo_job`` for its judge: the user the workers run as when the
  grader is root (``sandbox``).
- ``CS336_GRADE_ISOLATION``: ``subreaper`` starts the workers without namespaces even where they work
  (a machine where they get in the way of the GPU's drivers); passed on to the judge like the others.
- ``CS336_GRADE_NETWORK``: set by ``repo_job`` when it made a network of its own (``network``): that
  namespace's name, so that its judge can say so (a record naming another namespace says nothing).
- ``CS336_NCU``: the Nsight Compute binary that observes the leaderboard's run (``observer``), or ``0`` to
  grade without an observer (default: ``ncu`` on ``PATH``, then the usual install places).
- ``CS336_COURSE_TESTS_PORT``: set for a run of the course's tests (``course_tests``): the port its process
  groups use instead of the course's fixed 12390, so that runs side by side do not collide.
"""

from __future__ import annotations

import os

ADAPTERS_ENV = "CS336_ADAPTERS"
LOADED_ENV = "CS336_GRADE_LOADED"
SEED_ENV = "CS336_GRADE_SEED"
COURSE_PORT_ENV = "CS336_COURSE_TESTS_PORT"
HIDE_ENV = "CS336_GRADE_HIDE"
SCRATCH_ENV = "CS336_GRADE_SCRATCH"
WORKER_USER_ENV = "CS336_GRADE_WORKER_USER"
ISOLATION_ENV = "CS336_GRADE_ISOLATION"
NETWORK_ENV = "CS336_GRADE_NETWORK"
NCU_ENV = "CS336_NCU"


def adapters_from_env() -> str | None:
    return os.environ.get(ADAPTERS_ENV) or None


def loaded_before(adapters: str) -> bool:
    return os.environ.get(LOADED_ENV) == adapters


def mark_loaded(adapters: str) -> None:
    os.environ[LOADED_ENV] = adapters


def shared_seed() -> int | None:
    value = os.environ.get(SEED_ENV)
    return int(value) if value else None


def share_seed(seed: int) -> None:
    os.environ[SEED_ENV] = str(seed)


def hidden_from_env() -> list[str]:
    return [p for p in os.environ.get(HIDE_ENV, "").split(os.pathsep) if p]


def scratch_from_env() -> str | None:
    return os.environ.get(SCRATCH_ENV) or None


def worker_user_from_env() -> str | None:
    return os.environ.get(WORKER_USER_ENV) or None


def namespaces_wanted() -> bool:
    return os.environ.get(ISOLATION_ENV, "") != "subreaper"


def ncu_from_env() -> str | None:
    """The configured ``ncu`` (a path, or ``"0"``: no observer); ``None`` when unset."""
    return os.environ.get(NCU_ENV) or None


def network_from_env() -> str | None:
    return os.environ.get(NETWORK_ENV) or None


def set_network(namespace: str | None) -> None:
    if namespace is None:
        os.environ.pop(NETWORK_ENV, None)
    else:
        os.environ[NETWORK_ENV] = namespace
