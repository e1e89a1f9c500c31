"""Fixtures shared by tests/ and bench/: device, presets, dtypes, seeded generators, free ports and a
fixture that runs a function on N spawned ranks.

Markers (declared in pyproject.toml):
- ``gpu`` / ``gpu(n)``: skipped with a reason unless at least n CUDA devices are present.
- ``distributed``: forms a process group of spawned processes.
- ``slow``: long-running.
- ``hook(name, ...)``: a contract test of these grading hooks (``tests/contract/``).
- ``adapters_row``: a bench case of the adapters' implementation, dropped unless ``--adapters`` is given.

Options (``cs336_systems.grading.judge.pytest_plugin``, loaded by ``-p`` before any conftest):
``--adapters PATH`` (or ``CS336_ADAPTERS``) points the contract tests at any adapters file (default:
``tests/adapters.py``) and adds an ``adapters`` row to the attention, leaderboard, DDP and sharding
benches. This file's: ``--zip-submission=PATH`` (repeatable; with ``=``, or pytest takes PATH for a
test path), a real repository that the ``zip_env`` tests grade in the autograder's environment and
expect at its full score.
"""

from __future__ import annotations

import os
import shlex
from glob import glob
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

# Triton kernels run on the CPU only under the interpreter, and the flag is read when a kernel is
# decorated, so it has to be set before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # pytest-xdist runs one worker per core; torch's own intra-op threads on top only oversubscribe.
    # Only there: benches run serially (bench/conftest.py refuses xdist) with torch's default thread
    # count, as the CLI does, so both time the same thing; rows record it as "torch_threads".
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)

from cs336_systems.distributed.launch import find_free_port, spawn
from cs336_systems.grading.judge.pytest_plugin import requested_adapters, unimplemented
from cs336_systems.grading.sandbox import become_subreaper, descendants, kill_descendants
from cs336_systems.harness import adapters as adapters_hooks

if TYPE_CHECKING:  # the model package imports torch._dynamo (1.4 s): a fixture's first use imports it
    from cs336_systems.model import ModelConfig


def cuda_count() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--zip-submission",
        action="append",
        default=[],
        metavar="PATH",
        help="a real repository the zip_env tests grade in the autograder's environment (full score expected)",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"{adapters_hooks.MARKER}: a bench case of the adapters file, run only with --adapters"
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    path = requested_adapters(config)
    if path is None:  # no adapters file: its bench rows do not exist
        rows = [i for i in items if i.get_closest_marker(adapters_hooks.MARKER) is not None]
        if rows:
            config.hook.pytest_deselected(items=rows)
            items[:] = [i for i in items if i.get_closest_marker(adapters_hooks.MARKER) is None]
    for item in items:
        row = item.get_closest_marker(adapters_hooks.MARKER)
        reason = row and unimplemented(config, row.args)
        if reason:
            item.add_marker(pytest.mark.skip(reason=reason))
    available = cuda_count()
    for item in items:
        marker = item.get_closest_marker("gpu")
        if marker is None:
            continue
        needed = int(marker.args[0]) if marker.args else 1
        if available < needed:
            have = f"{available} present" if available else "none present (CPU-only machine)"
            item.add_marker(pytest.mark.skip(reason=f"needs {needed} CUDA GPU(s); {have}"))


@pytest.fixture(scope="session")
def device() -> torch.device:
    """cuda:0 when a GPU is present, else cpu."""
    return torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture(scope="session")
def hopper(device: torch.device) -> torch.device:
    """The device, for tests of the Gluon kernels (built for Hopper's wgmma); skips elsewhere, where their
    configs run Triton's kernels."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) != (9, 0):
        pytest.skip("the Gluon kernels are built for Hopper (wgmma); elsewhere their configs run Triton's")
    return device


def _language_attributes() -> dict:
    """The own attributes of the Triton language modules and classes that the interpreter patches."""
    import triton.language as tl

    owners = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base)
    return {(owner, name): value for owner in owners for name, value in vars(owner).items()}


# Taken at collection, before any kernel of the session is interpreted.
_PRISTINE_LANGUAGE = _language_attributes()


@pytest.fixture
def pristine_triton_language(monkeypatch):
    """triton.language as imported, for the duration of a test. Triton 3.6's interpreter patches it for
    every device-function call and restores it only after whole kernels (``InterpretedFunction.__call__``),
    so once any kernel with helpers has been interpreted in this process, compiling for a GPU finds
    interpreter lambdas where builtins were (``'ir.value' object has no attribute 'dtype'``)."""
    missing = object()
    for owner, name in _language_attributes().keys() - _PRISTINE_LANGUAGE.keys():
        monkeypatch.delattr(owner, name)
    for (owner, name), value in _PRISTINE_LANGUAGE.items():
        if vars(owner).get(name, missing) is not value:
            monkeypatch.setattr(owner, name, value)


@pytest.fixture(scope="session")
def presets() -> dict[str, ModelConfig]:
    from cs336_systems.model import PRESETS

    return PRESETS


@pytest.fixture(scope="session")
def tiny_config() -> ModelConfig:
    from cs336_systems.model import PRESETS

    return PRESETS["tiny"]


@pytest.fixture(params=[torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def dtype(request: pytest.FixtureRequest) -> torch.dtype:
    return request.param


@pytest.fixture
def seed() -> int:
    """Seeds torch's global generator too, so code that draws without a generator is repeatable."""
    torch.manual_seed(0)
    return 0


@pytest.fixture
def generator(seed: int) -> torch.Generator:
    """A seeded CPU generator; draw on the CPU and move, so results match across devices."""
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def free_port() -> int:
    return find_free_port()


@pytest.fixture
def reaped():
    """Every process the test starts, and every process those leave behind (a rank whose launcher was
    killed at a time limit), is killed at the test's end, also when it fails. This process becomes a
    subreaper, so that orphans are re-parented here rather than to PID 1; processes that were running
    before the test (a session fixture's) are left alone."""
    become_subreaper()
    before = frozenset(descendants())
    yield
    kill_descendants(keep=before)


@pytest.fixture
def run_distributed(reaped):
    """``run_distributed(fn, world_size, *args, backend=None, timeout=120)`` runs ``fn(*args)`` on
    ``world_size`` spawned ranks inside an initialized process group (gloo on CPU, nccl when every
    rank has a GPU) and returns the list of per-rank return values. Each call takes its own free
    port; a rank that raises fails the call with that rank's traceback, and the other ranks are
    killed instead of waiting for it; a run that exceeds ``timeout`` seconds is killed and fails.
    ``fn`` must be importable (a module-level function), as spawned processes re-import it.
    """
    return spawn


@pytest.fixture(scope="session")
def matmul_tflops(device: torch.device):
    """``matmul_tflops(dtype)`` -> the dense matmul rate (TFLOP/s) measured once per session on this
    device and dtype: the denominator of every MFU the benches report."""
    from cs336_systems.profiling.flops import measure_matmul_tflops

    cache: dict[torch.dtype, float] = {}

    def rate(dtype: torch.dtype) -> float:
        if dtype not in cache:
            cache[dtype] = measure_matmul_tflops(device, dtype)
        return cache[dtype]

    return rate


@pytest.fixture
def fresh_flash():
    """The FlashAttention plans, tuning results and record of what ran, empty before and after a test (a
    test that fakes a launcher must not leave plans built on it to later tests)."""
    from cs336_systems.kernels import flash

    flash.clear_tuning_cache()
    yield
    flash.clear_tuning_cache()


@pytest.fixture
def deterministic_flag():
    """``deterministic_flag(on)`` sets torch's deterministic-algorithms flag for the test; the flag (and its
    warn-only mode) is as it was afterwards."""
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    yield lambda on: torch.use_deterministic_algorithms(on)
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


@pytest.fixture(scope="session")
def readme_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The README's "Results" command, run once as a user runs it from the repository root (its globs
    expanded there, as a shell would): the folder it wrote (``writeup.md``, ``tables/``)."""
    from cs336_systems import report

    root = Path(__file__).resolve().parent
    readme = (root / "README.md").read_text().splitlines()
    line = next(ln for ln in readme if "-m cs336_systems.report docs/results" in ln)
    args = shlex.split(line.split("-m cs336_systems.report", 1)[1])
    paths = [p for a in args[: args.index("--out")] for p in (sorted(glob(str(root / a))) or [str(root / a)])]
    out = tmp_path_factory.mktemp("readme-report")
    assert report.main([*paths, "--out", str(out)]) == 0
    return out
