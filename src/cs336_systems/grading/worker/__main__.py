"""A grading worker: ``python <this file> JOB.json``, started by ``cs336_systems.grading.runner``.

Run as a file, never as ``-m cs336_systems...``: this process's ``cs336_systems`` must be the student's.
It loads this folder as the private package ``_cs336_grader``, makes the import system the student's
(``isolate``), loads the adapters file, runs one task on it and writes the result as JSON to the path
in ``CS336_GRADE_OUT``. Exit codes: 0 done, 3 the adapters file did not load, 4 refused (the suite's own
code answered a hook).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PACKAGE = "_cs336_grader"


def _install_package() -> None:
    spec = importlib.util.spec_from_file_location(
        PACKAGE, HERE / "__init__.py", submodule_search_locations=[str(HERE)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = module
    spec.loader.exec_module(module)


def _write(payload: dict) -> None:
    importlib.import_module(f"{PACKAGE}.settings").out_path().write_text(json.dumps(payload))


def main(job_file: str) -> int:
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        del sys.path[0]
    _install_package()
    job = json.loads(Path(job_file).read_text())
    isolate = importlib.import_module(f"{PACKAGE}.isolate")
    hooks_mod = importlib.import_module(f"{PACKAGE}.hooks")
    isolate.isolate(job["paths"], job["suite_paths"], job["dists"])
    try:
        module = isolate.load_adapters(job["adapters"])
    except isolate.AdaptersError as exc:
        _write({"error": str(exc), "kind": "load"})
        return 3
    hooks = hooks_mod.Hooks(module, job.get("forbidden"))
    task_module, _, task = job["task"].partition(".")
    try:
        if task_module == "probe":
            result = hooks_mod.probe(module)
        else:
            dist = importlib.import_module(f"{PACKAGE}.dist")
            dist.init(job.get("backend", "gloo"))
            result = getattr(importlib.import_module(f"{PACKAGE}.{task_module}"), task or "run")(
                hooks, job["args"]
            )
            dist.close()
    except hooks_mod.SuiteCodeGraded as exc:
        _write({"error": str(exc), "kind": "refused"})
        return 4
    _write({"result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
