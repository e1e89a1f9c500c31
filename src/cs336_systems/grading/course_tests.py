"""The graded repository's own course tests (its ``tests/test_*.py``), run from its root the way its
owner runs them, and mapped to hook groups: what the grader's course tier must agree with.

Each course test module imports its hooks from ``.adapters``; a test counts for the group of the first
hook it imports (the grader's groups: ``get_ddp`` with ``ddp_on_after_backward``, ...). Nothing is
installed: the repository's roots go first on ``PYTHONPATH`` and a throwaway ``.dist-info`` answers
``importlib.metadata.version`` (as in the grader's workers). A student owns these tests; they are a
cross-check of the grader, never its verdict.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

from .probe import ALL_HOOKS
from .roots import StudentRoots, suite_paths
from .worker.cases import CASES

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


def _metadata(roots: StudentRoots, folder: Path) -> None:
    for name, version in roots.dists.items():
        info = folder / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir(parents=True, exist_ok=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def run(roots: StudentRoots, timeout: float = 900.0) -> dict[str, dict]:
    """Per hook group: the course tests' counts (passed / failed / skipped) and the failing tests."""
    tests = roots.repo_root / "tests"
    group_of_module, group_of_function = {}, {}
    for module in sorted(tests.glob("test_*.py")):
        imported, functions = hooks_of(module)
        if imported:
            group_of_module[module.stem] = GROUP_OF[imported[0]]
            group_of_function |= {(module.stem, f): g for f, g in functions.items()}
    with tempfile.TemporaryDirectory(prefix="cs336-course-tests-") as tmp:
        folder = Path(tmp)
        _metadata(roots, folder / "dist")
        banned = {Path(p).resolve() for p in suite_paths()}
        kept = [
            p
            for p in os.environ.get("PYTHONPATH", "").split(os.pathsep)
            if p and Path(p).resolve() not in banned
        ]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "CS336_"))}
        env["PYTHONPATH"] = os.pathsep.join([*roots.paths(), str(folder / "dist"), *kept])
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "tests",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            f"--junitxml={folder / 'junit.xml'}",
            "-p",
            "no:randomly",
        ]
        subprocess.run(cmd, cwd=roots.repo_root, env=env, capture_output=True, text=True, timeout=timeout)
        report = folder / "junit.xml"
        cases = ET.parse(report).getroot().iter("testcase") if report.is_file() else []
        groups: dict[str, dict] = {}
        for case in cases:
            module = (case.get("classname") or "").split(".")[-1]
            if module not in group_of_module:
                continue
            status = (
                "failed"
                if case.find("failure") is not None or case.find("error") is not None
                else ("skipped" if case.find("skipped") is not None else "passed")
            )
            function = (case.get("name") or "").split("[")[0]
            group = group_of_function.get((module, function), group_of_module[module])
            g = groups.setdefault(group, {"counts": Counter(), "failed": []})
            g["counts"][status] += 1
            if status == "failed":
                g["failed"].append(f"{module}::{case.get('name')}")
    return {k: {"counts": dict(v["counts"]), "failed": v["failed"]} for k, v in groups.items()}


def agreement(course: dict[str, dict], groups: dict[str, dict], cases: list[dict]) -> dict[str, str]:
    """Per hook group: whether the grader's course tier and the course tests say the same. A blank hook
    fails the course's tests (it raises NotImplementedError) and is "not implemented" to the grader: the
    same finding."""
    blank = {c["hooks"][0] for c in cases if c["tier"] == "course" and c["kind"] == "not-implemented"}
    out = {}
    for name, row in groups.items():
        theirs = course.get(name)
        if theirs is None:
            out[name] = "no course test"
            continue
        c = theirs["counts"]
        course_says = "fail" if c.get("failed") else "pass" if c.get("passed") else "skip"
        ours = row["course"]
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
