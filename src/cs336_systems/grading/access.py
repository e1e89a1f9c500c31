"""Whether the worker user (``--worker-user``, when grading as root) can run the grading at all: run the
grading interpreter and read its packages, the suite's worker, and every file of the submissions.

Checked before anything starts, as that user (a small script run through ``setpriv``), because a
grading environment only its owner can read (tox makes ``.tox/`` so) otherwise fails every case as
the student's ("No module named 'torch'"). What it cannot read is named with the folder that stops it
(its mode and owner), as one line.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pwd
import stat
import subprocess
import sys
from pathlib import Path

from .roots import SKIP_DIRS  # the folders that hold no code of the submission

GRADING = Path(__file__).resolve().parent
# Run as the worker user by the machine's own interpreter: prints each place it cannot reach, and the
# first folder on the way that it cannot enter (or the place itself).
CHECK = r"""
import json, os, sys
for path, mode in json.load(sys.stdin):
    if os.access(path, mode):
        continue
    parts = path.split("/")
    folders = ["/".join(parts[:i]) or "/" for i in range(1, len(parts))]
    stop = next((f for f in folders if not os.access(f, os.X_OK)), path)
    print(json.dumps([path, stop]))
"""


def places(submissions: list[Path]) -> list[tuple[str, int]]:
    """What a worker reads (mode ``R_OK``, ``X_OK``): the interpreter and its packages (the venv's
    configuration, where the grading environment's packages are), the suite's worker, and the
    submissions' files (their ``.py`` and ``.toml`` files, and every folder holding them)."""
    read, enter = os.R_OK, os.R_OK | os.X_OK
    found = [(sys.executable, os.X_OK), (str(Path(sys.prefix) / "pyvenv.cfg"), read)]
    torch = importlib.util.find_spec("torch")  # found, not imported
    for folder in (torch.submodule_search_locations or []) if torch else []:
        found.append((folder, enter))
    found += [(str(GRADING / "worker" / "__main__.py"), read), (str(GRADING / "shared"), enter)]
    for root in submissions:
        found += _tree(root.parent.parent if root.is_file() else root)
    return [(p, m) for p, m in found if os.path.lexists(p)]


def _tree(root: Path) -> list[tuple[str, int]]:
    found = [(str(root), os.R_OK | os.X_OK)]
    for folder, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if d not in SKIP_DIRS]
        found += [(str(Path(folder) / d), os.R_OK | os.X_OK) for d in dirs]
        found += [(str(Path(folder) / f), os.R_OK) for f in files if f.endswith((".py", ".toml"))]
    return found


def worker_cannot_read(user: str, submissions: list[Path]) -> str | None:
    """Why ``user`` cannot run the grading here (one line), or None. Only a root grader runs the
    graded code as another user (``Sandbox``): otherwise there is nothing to check."""
    try:
        entry = pwd.getpwnam(user)
    except KeyError:
        return f"--worker-user {user}: no such user on this machine"
    if os.geteuid() != 0:
        return None
    python = os.path.realpath(sys.executable)
    cmd = ["setpriv", f"--reuid={entry.pw_uid}", f"--regid={entry.pw_gid}", "--init-groups", "--"]
    cmd += [python, "-I", "-S", "-c", CHECK]
    todo = json.dumps(places(submissions))
    run = subprocess.run(cmd, input=todo, capture_output=True, text=True, timeout=120, cwd="/")
    if run.returncode != 0:
        said = (run.stderr.strip().splitlines() or ["no output"])[-1]
        return f"the worker user {user} cannot run {python}: {said}"
    blocked = [json.loads(line) for line in run.stdout.splitlines() if line.strip()]
    if not blocked:
        return None
    path, stop = blocked[0]
    more = f" (and {len(blocked) - 1} more)" if len(blocked) > 1 else ""
    return (
        f"the worker user {user} cannot read {path}{more}: {_shown(stop)} stops it; make it readable "
        f"(chmod o+rX), or grade without --worker-user"
    )


def _shown(path: str) -> str:
    try:
        st = os.stat(path)
    except OSError:
        return path
    try:
        owner = pwd.getpwuid(st.st_uid).pw_name
    except KeyError:
        owner = str(st.st_uid)
    return f"{path} ({stat.filemode(st.st_mode)}, owner {owner})"
