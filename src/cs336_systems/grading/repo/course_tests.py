"""The course's tests run on the graded repository's adapters file, and mapped to hook groups: what the
grader's course tier must agree with.

The tests are a course release's ``tests/`` folder (``--course-tests PATH``; students edit their own
copies: one switched its DDP test to nccl, one its FSDP test to layers of its own), copied beside the
repository's ``adapters.py`` into a folder of their own and run there as graders run them; without a
path, the repository's own ``tests/`` run from its root.

Each course test module imports its hooks from ``.adapters``; a test counts for the group of the first
hook it imports (the grader's groups: ``get_ddp`` with ``ddp_on_after_backward``, ...). Nothing is
installed: the repository's roots go first on ``PYTHONPATH`` and a throwaway ``.dist-info`` answers
``importlib.metadata.version`` (as in the grader's workers). A student owns these tests; they are a
cross-check of the grader, never its verdict.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from cs336_systems.distributed.launch import find_free_port

from ..limits import Limits
from ..probe import ALL_HOOKS
from ..roots import GradingSetupError, StudentRoots, grader_pythonpath
from ..sandbox import JobFolder, Sandbox, jobs_parent, walls_message
from ..settings import COURSE_PORT_ENV
from ..shared.cases import CASES, COURSE, NOT_IMPLEMENTED

GROUP_OF = {h: case.hooks[0] for case in CASES.values() for h in case.hooks}


def hooks_of(module: Path) -> tuple[list[str], dict[str, str]]:
    """The hooks a course test module imports from its adapters (in import order), and each test
    function's group when its own body names a hook (``test_flash_forward_pass_triton`` calls the
    Triton hook; ``test_ddp`` spawns a helper, so it takes the module's)."""
    tree = ast.parse(module.read_text())
    imported = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("adapters"):
            imported += [a.name for a in node.names if a.name in ALL_HOOKS]
    functions = {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test"):
            named = [n.id for n in ast.walk(node) if isinstance(n, ast.Name) and n.id in ALL_HOOKS]
            if named:
                functions[node.name] = GROUP_OF[named[0]]
    return imported, functions


# The course's tests fix MASTER_PORT to 12390, so two runs on one machine collide: each run gets a free
# port of its own, put in place of that one where the tests start their process group (nothing else of
# the tests changes). Loaded by every process of the run as ``sitecustomize``.
PORT_SHIM = """
import os
if os.environ.get("{env}"):
    import torch.distributed as _dist

    _init = _dist.init_process_group

    def _init_on_own_port(*args, **kwargs):
        if os.environ.get("MASTER_PORT") == "12390":
            os.environ["MASTER_PORT"] = os.environ["{env}"]
        return _init(*args, **kwargs)

    _dist.init_process_group = _init_on_own_port
"""


def _metadata(roots: StudentRoots, folder: Path) -> None:
    (folder / "sitecustomize.py").parent.mkdir(parents=True, exist_ok=True)
    (folder / "sitecustomize.py").write_text(PORT_SHIM.format(env=COURSE_PORT_ENV))
    for name, version in roots.dists.items():
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def release_for(roots: StudentRoots, tests: Path | None) -> Path | None:
    """The course tests to run: ``tests`` itself when it holds test files, else its ``<version>/tests``
    for the repository's version (a folder of releases: ``1.0.5/tests``, ``26.1.4/tests``); None for the
    repository's own. A folder of releases without the repository's version is an error naming them."""
    if tests is None or any(tests.glob("test_*.py")):
        return tests
    version = roots.dists.get("cs336-systems", "")
    found = tests / version / "tests"
    if not found.is_dir():
        have = sorted(p.parent.name for p in tests.glob("*/tests"))
        raise GradingSetupError(f"no course tests for release {version!r} under {tests} (it has {have})")
    return found


def _place(roots: StudentRoots, release: Path | None, folder: Path) -> Path:
    """The folder the tests run from: the repository's root, or a new one holding the release's tests
    with the repository's adapters file among them."""
    if release is None:
        return roots.repo_root
    shutil.copytree(release, folder / "tests", ignore=shutil.ignore_patterns("adapters.py", "__pycache__"))
    shutil.copy(roots.adapters, folder / "tests" / "adapters.py")
    return folder


def run(roots: StudentRoots, release: Path | None = None, timeout: float | None = None) -> dict[str, dict]:
    """Per hook group: the course tests' counts (passed / failed / skipped) and the failing tests; the
    tests get ``timeout`` seconds (default: their share of the default repository limit)."""
    timeout = Limits().course_tests_s if timeout is None else timeout
    job = JobFolder.make(jobs_parent(), prefix="course-tests-")
    try:
        return _run(roots, _place(roots, release, job.path / "root"), job, timeout)
    finally:
        job.remove()


def _groups_of(tests: Path) -> tuple[dict[str, str], dict[tuple[str, str], str]]:
    """Each test module's hook group, and each test function's where its body names a hook."""
    of_module, of_function = {}, {}
    for module in sorted(tests.glob("test_*.py")):
        imported, functions = hooks_of(module)
        if imported:
            of_module[module.stem] = GROUP_OF[imported[0]]
            of_function |= {(module.stem, f): g for f, g in functions.items()}
    return of_module, of_function


def _env(roots: StudentRoots, dist: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CS336_"))}
    env["PYTHONPATH"] = os.pathsep.join([*roots.paths(), str(dist), *grader_pythonpath(os.environ)])
    env[COURSE_PORT_ENV] = str(find_free_port())
    return env


def _run(roots: StudentRoots, where: Path, job: JobFolder, timeout: float) -> dict[str, dict]:
    """The tests in the graded code's sandbox, as a worker runs (they are the student's code too): they
    write only their JUnit report, their ``/tmp`` and the repository's scratch."""
    of_module, of_function = _groups_of(where / "tests")
    _metadata(roots, job.path / "dist")
    junit = job.out / "junit.xml"
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-p", "no:cacheprovider", "-o", "addopts="]
    cmd += [f"--junitxml={junit}", "-p", "no:randomly"]
    sandbox = Sandbox.from_env()
    sandbox.prepare(job)
    read_end, write_end = os.pipe()
    wrapped = sandbox.wrap(cmd, job, roots.folders(), where, ready_fd=write_end)
    env = _env(roots, job.path / "dist") | sandbox.env()
    try:
        subprocess.run(
            wrapped,
            cwd=where,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            pass_fds=(write_end,),
        )
    except subprocess.TimeoutExpired:
        pass  # the tests that finished are in the report
    finally:
        os.close(write_end)
    if (said := walls_message(read_end)) not in (None, "ok"):
        raise GradingSetupError(f"the course tests could not run in the grader's sandbox: {said}")
    groups: dict[str, dict] = {}
    for case in ET.parse(junit).getroot().iter("testcase") if junit.is_file() else []:
        module = (case.get("classname") or "").split(".")[-1]
        if module not in of_module:
            continue
        failed = case.find("failure") is not None or case.find("error") is not None
        status = "failed" if failed else "skipped" if case.find("skipped") is not None else "passed"
        group = of_function.get((module, (case.get("name") or "").split("[")[0]), of_module[module])
        g = groups.setdefault(group, {"counts": Counter(), "failed": []})
        g["counts"][status] += 1
        if failed:
            g["failed"].append(f"{module}::{case.get('name')}")
    return {k: {"counts": dict(v["counts"]), "failed": v["failed"]} for k, v in groups.items()}


def agreement(course: dict[str, dict], groups: dict[str, dict], cases: list[dict]) -> dict[str, str]:
    """Per hook group: whether the grader's course tier and the course tests say the same. A blank hook
    fails the course's tests (it raises NotImplementedError) and is "not implemented" to the grader: the
    same finding."""
    blank = {c["hooks"][0] for c in cases if c["tier"] == COURSE and c["kind"] == NOT_IMPLEMENTED}
    out = {}
    for name, row in groups.items():
        theirs = course.get(name)
        if theirs is None:
            out[name] = "no course test"
            continue
        c = theirs["counts"]
        course_says = "fail" if c.get("failed") else "pass" if c.get("passed") else "skip"
        ours = row[COURSE]
        grader_says = (
            "fail" if ours.get("failed") or ours.get("error") else "pass" if ours.get("passed") else "skip"
        )
        if course_says == grader_says:
            out[name] = f"agree ({course_says})"
        elif name in blank and course_says == "fail":
            out[name] = "agree (not implemented)"
        elif (
            course_says == "skip"
        ):  # e.g. the Triton tests on a CPU, which the grader runs under the interpreter
            out[name] = f"course tests skipped here; grader {grader_says}"
        else:
            out[name] = f"DISAGREE: course tests {course_says}, grader {grader_says}"
    return out
