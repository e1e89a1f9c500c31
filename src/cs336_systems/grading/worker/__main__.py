"""A grading worker: ``python <this file> JOB.json``, started by ``cs336_systems.grading.judge.runner``.

It computes and never judges. Run as a file, never as ``-m cs336_systems...``: this process's
``cs336_systems`` must be the student's. It loads this folder and ``../shared`` as the private packages
``_cs336_grader.worker`` and ``_cs336_grader.shared``, makes the import system the student's (``isolate``), loads the adapters file, and for each case it was
asked for runs the hooks on the judge's inputs (``inputs/<case>.pt``) and saves what came out to
``<out>/<case>.rank<r>.pt`` (tensors and plain data, read back with ``torch.load(weights_only=True)``).
Everything written here is untrusted by the judge, which checks it against references it computes
itself. Exit codes: 0 done, 3 the adapters file did not load, 4 refused (the suite's own code answered).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

STARTED = time.monotonic()
HERE = Path(__file__).resolve().parent
PACKAGE = "_cs336_grader"
SUBPACKAGES = {"worker": HERE, "shared": HERE.parent / "shared"}


def _install_packages() -> None:
    """``_cs336_grader.worker`` (this folder) and ``_cs336_grader.shared``: the worker's modules reach
    the shared ones as ``..shared``, as they do in the judging process. The top package has no folder,
    so nothing else of the grader (the judge above all) can be imported through it here."""
    top_spec = importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True)
    top = importlib.util.module_from_spec(top_spec)
    sys.modules[PACKAGE] = top
    for name, folder in SUBPACKAGES.items():
        spec = importlib.util.spec_from_file_location(
            f"{PACKAGE}.{name}", folder / "__init__.py", submodule_search_locations=[str(folder)]
        )
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        setattr(top, name, module)


def _mod(name: str) -> Any:
    """A module of this folder (``isolate``), or of the shared one (``shared.cases``)."""
    dotted = name if name.startswith("shared.") else f"worker.{name}"
    return importlib.import_module(f"{PACKAGE}.{dotted}")


def _save(job: dict, name: str, payload: dict) -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    body = {"token": job["token"], "case": name, "rank": rank, **payload}
    torch.save(body, Path(job["out"]) / f"{name}.rank{rank}.pt")


def _run_case(job: dict, hooks: Any, case_id: str, rank: int) -> dict:
    import torch

    cases, dist, outcome = _mod("shared.cases"), _mod("dist"), _mod("outcome")
    provenance = _mod("provenance")
    case = cases.CASES[case_id]
    device = dist.device_for(case.device, rank)
    inputs = torch.load(Path(job["inputs"]) / f"{case_id}.pt", weights_only=True)
    recorder = provenance.Recorder()
    started = time.monotonic()
    try:
        if case.family == "attention":
            fn = getattr(hooks, case.hooks[0])()
            result = _mod("attention").run(fn, case, inputs, device, recorder)
        else:
            result = _mod(case.family).run(hooks, case, inputs, device, rank)
        result = _to_cpu(result)
        status: dict[str, Any] = {"status": "done", "result": result}
    except Exception as exc:
        status = {"status": "raised", **outcome.describe(exc, job["roots"])}
    if case.family == "attention":
        status["provenance"] = recorder.report(job["roots"])
    # how long the case took here, and when it began after this process started: for the progress
    # lines only, never read by a judge
    timing = {"seconds": round(time.monotonic() - started, 2), "began_s": round(started - STARTED, 2)}
    return {"device": str(device), **timing, **status}


def _to_cpu(obj: Any) -> Any:
    import torch

    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_to_cpu(v) for v in obj]
    return obj


def main(job_file: str) -> int:
    if sys.path and Path(sys.path[0] or ".").resolve() == HERE:
        del sys.path[0]
    _install_packages()
    job = json.loads(Path(job_file).read_text())
    isolate = _mod("isolate")
    isolate.isolate(job["paths"], job["suite_paths"], job["dists"])
    try:
        module = isolate.load_adapters(job["adapters"])
    except isolate.AdaptersError as exc:
        _save(job, "load", {"status": "load-error", "message": str(exc)})
        return 3
    if job["task"] == "load":
        _save(job, "load", {"status": "loaded"})
        return 0
    hooks_mod, dist = _mod("hooks"), _mod("dist")
    hooks = hooks_mod.Hooks(module, job.get("forbidden"))
    rank, world_size = dist.init(job.get("backend", "gloo"))
    try:
        if job["task"] == "cases":
            for case_id in job["cases"]:
                payload = _run_case(job, hooks, case_id, rank)
                _save(job, case_id, payload)
                if payload["status"] != "done" and world_size > 1:
                    os._exit(5)  # its peers may wait on it in a collective: the runner stops them
        else:  # timing.<function>
            timing = getattr(_mod("timing"), job["task"].partition(".")[2])
            result = timing(hooks, job["args"], job["roots"], job)
            _save(job, "timing", {"status": "done", "result": _to_cpu(result)})
    except hooks_mod.SuiteCodeGraded as exc:
        _save(job, "refused", {"status": "refused", "message": str(exc)})
        return 4
    dist.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
