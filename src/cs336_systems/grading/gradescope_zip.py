"""The scripts of Gradescope's autograder zip (``cli/autograder.py`` writes them): ``setup.sh``,
``run_autograder`` and ``finish.py``. Shell text with ``@NAME@`` slots that ``render`` fills in, so that
the shell's own braces stay as they are.

``setup.sh`` builds the grading environment the way tox builds the suite's: the pins of
``requirements/pins.txt`` as requirements and as constraints (torch, Triton, numpy; nothing else can
move them), the suite with its test extras, and the students' dependencies (``student-deps.txt`` of the
zip). It finds a Python the suite runs on (``requires-python``) or installs one, so it works on any
Ubuntu base image, and it can run again (a rebuilt image, a stand-in root) without changing anything.
"""

from __future__ import annotations

import re

SETUP_SH = r"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image; a second run changes nothing.
# Base image: Ubuntu 24.04 (its python3 is 3.12). On 22.04 (python3 3.10, older than the suite's
# @MIN@) apt's python3.11 (universe), else a CPython 3.12 fetched by uv, is installed first.
set -euo pipefail
ROOT=${AUTOGRADER_ROOT:-/autograder}
SOURCE=$ROOT/source
VENV=$SOURCE/venv
PINS=$SOURCE/suite/requirements/pins.txt
STUDENT_DEPS=$SOURCE/student-deps.txt

# $1 is at least the suite's Python and can make a virtualenv with pip (Ubuntu ships venv apart).
suitable() {
    "$1" -c 'import sys, ensurepip, venv; sys.exit(sys.version_info < (@MIN_TUPLE@))' >/dev/null 2>&1
}

# The first suitable interpreter: the one asked for, else 3.12 (the course's), else what python3 is.
find_python() {
    local name
    for name in ${CS336_SETUP_PYTHON:-} python3.12 python3 python3.13 python3.11; do
        if command -v "$name" >/dev/null && suitable "$name"; then
            "$name" -c 'import sys; print(sys.executable)'
            return 0
        fi
    done
    return 1
}

# None is here: the distribution's (with its venv package), else uv's standalone CPython.
install_python() {
    if command -v apt-get >/dev/null; then
        apt-get update -qq || true
        local v
        for v in 3.12 3.11; do
            if apt-get install -y -qq "python$v" "python$v-venv"; then return 0; fi
        done
    fi
    local uv=$SOURCE/uv/bin/uv
    python3 -m pip install -q --target "$SOURCE/uv" uv || return 1
    UV_PYTHON_INSTALL_DIR=$SOURCE/python "$uv" python install 3.12 || return 1
    CS336_SETUP_PYTHON=$(UV_PYTHON_INSTALL_DIR=$SOURCE/python "$uv" python find 3.12) || return 1
    export CS336_SETUP_PYTHON
}

python_for_venv() {
    find_python && return 0
    install_python >&2 && find_python && return 0
    echo "setup.sh: no Python >= @MIN@ with venv here, and none could be installed" >&2
    return 1
}

# torch's CPU wheels (about 200 MB; Gradescope has no GPU). PyPI's torch 2.13.0 is the CUDA build: 1.8 GB
# more, and it requires triton 3.7.1, which the pins refuse. CS336_TORCH_INDEX: another index, or "none"
# for pip's own configuration alone.
TORCH_INDEX=${CS336_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}

main() {
    set -x
    local python
    python=$(python_for_venv)
    # A virtualenv of a Python that is gone or too old (an earlier base image) is made again.
    if ! suitable "$VENV/bin/python"; then
        rm -rf "$VENV"
        "$python" -m venv "$VENV"
    fi
    local extra=()
    if [ "$TORCH_INDEX" != none ]; then extra=(--extra-index-url "$TORCH_INDEX"); fi
    # The pins as requirements and as constraints (the file tox installs from): neither the suite nor
    # a student's dependency can move numpy, torch or Triton.
    "$VENV/bin/python" -m pip install -q --no-input "${extra[@]}" -r "$PINS" -c "$PINS" \
        -r "$STUDENT_DEPS" "$SOURCE/suite[test]"
    "$VENV/bin/python" -c 'import numpy, torch, triton
print("grading with torch", torch.__version__, "CUDA", torch.version.cuda, "triton", triton.__version__,
      "numpy", numpy.__version__)'
    if [ "$(id -u)" = 0 ]; then grader_user; fi
}

# The graded code runs as this user: it cannot write the grader's files or the results. It must run the
# grading interpreter itself (torch.compile's workers start it again): a virtualenv made from a Python
# under a private home would grade every such case as failed, so the build stops here instead.
grader_user() {
    id @USER@ >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin @USER@
    if ! runuser -u @USER@ -- "$VENV/bin/python" -c 'import torch, triton'; then
        echo "setup.sh: @USER@ cannot run $VENV/bin/python; make it from a Python all users can read" >&2
        return 1
    fi
}

# Sourced (the suite's tests), it only defines the functions.
if [ "${BASH_SOURCE[0]}" = "$0" ]; then main; fi
"""

RUN_AUTOGRADER = r"""#!/usr/bin/env bash
# Gradescope runs this per submission. Whatever happens, results/results.json is written.
set -u
ROOT=${AUTOGRADER_ROOT:-/autograder}
SOURCE=$ROOT/source
PYTHON=${CS336_PYTHON:-$SOURCE/venv/bin/python}
WORK=$(mktemp -d)
START=$(date +%s)
mkdir -p "$ROOT/results"
USER_OPTION=()
# The graded code runs as the unprivileged user where the grader supports it and the user exists.
# CS336_WORKER_USER="" keeps it the grader's (a stand-in whose interpreter that user cannot read).
WORKER_USER=${CS336_WORKER_USER-@USER@}
if [ -n "$WORKER_USER" ] && id "$WORKER_USER" >/dev/null 2>&1 && \
    (cd "$SOURCE/suite" && PYTHONPATH=src "$PYTHON" -m cs336_systems.cli.grade --help 2>/dev/null) | grep -q -- --worker-user; then
    USER_OPTION=(--worker-user "$WORKER_USER")
fi
# CS336_GRADE_ARGS is split on purpose: it holds several arguments (e.g. "-- -k ddp").
(cd "$SOURCE/suite" && PYTHONPATH=src timeout "${CS336_GRADE_TIMEOUT:-3000}" "$PYTHON" -m cs336_systems.cli.grade \
    "$ROOT/submission" --out "$WORK/grade" --tiers course "${USER_OPTION[@]}" ${CS336_GRADE_ARGS:-}) \
    >"$WORK/grade.log" 2>&1
RC=$?
cat "$WORK/grade.log"
# Where finish.py cannot run (the grading interpreter is gone: a broken image), the same fields by hand.
"$PYTHON" "$SOURCE/finish.py" "$WORK/grade/submission/results.json" "$WORK/grade.log" "$RC" "$START" \
    "$ROOT/results/results.json" || \
    printf '{"score": 0, "execution_time": %d, "output": "%s (exit %d)", "visibility": "visible",
 "stdout_visibility": "hidden", "extra_data": {"grade_exit": %d}, "leaderboard": [],
 "tests": [{"name": "grader failed", "score": 0, "max_score": 0, "status": "failed", "output": "%s",
 "tags": ["grader"], "visibility": "visible"}]}\n' "$(($(date +%s) - START))" \
    "the autograder failed before it could grade" "$RC" "$RC" \
    "the grading interpreter could not run: see the autograder's output" >"$ROOT/results/results.json"
"""

FINISH_PY = '''"""Write Gradescope's results.json: the grader's, with every top-level field Gradescope documents,
or, when grading failed, one visible failed test that says why. Standard library only."""

import json
import sys
import time
from pathlib import Path

graded, log, rc, start, out = sys.argv[1:6]
elapsed = round(time.time() - float(start), 1)
tail = "\\n".join(Path(log).read_text(errors="replace").splitlines()[-15:]) if Path(log).is_file() else ""
try:
    doc = json.loads(Path(graded).read_text())
    assert isinstance(doc.get("tests"), list) and doc["tests"]
except (OSError, ValueError, AssertionError):
    why = "the submission could not be graded" if rc != "0" else "the grader wrote no results"
    doc = {
        "score": 0,
        "output": f"{why} (exit {rc})",
        "tests": [
            {"name": "grader failed", "score": 0, "max_score": 0, "status": "failed",
             "output": tail or "no output", "tags": [], "visibility": "visible"}
        ],
    }
doc.setdefault("score", sum(t.get("score", 0) for t in doc["tests"]))
doc["execution_time"] = elapsed
doc.setdefault("output", f"graded in {elapsed:.0f} s (exit {rc})")
doc.setdefault("visibility", "visible")
doc.setdefault("stdout_visibility", "hidden")
doc.setdefault("extra_data", {"grade_exit": int(rc)})
doc.setdefault("leaderboard", [])
for test in doc["tests"]:
    test.setdefault("tags", [])
    test.setdefault("visibility", "visible")
Path(out).write_text(json.dumps(doc, indent=1))
'''


def render(template: str, slots: dict[str, str]) -> str:
    """``template`` with each ``@NAME@`` replaced; a slot left over is a bug of this module."""
    for name, value in slots.items():
        template = template.replace(f"@{name}@", value)
    left = re.findall(r"@[A-Z_]+@", template)
    assert not left, f"unfilled slots {left}"
    return template
