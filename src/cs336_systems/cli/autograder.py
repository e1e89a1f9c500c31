"""Build Gradescope's autograder: ``python -m cs336_systems.cli.autograder --out autograder.zip``.

The zip holds what Gradescope takes: ``setup.sh`` (run once when the image is built: a virtualenv with
the suite, its pinned torch and Triton, and an unprivileged user for the graded code), ``run_autograder``
(run per submission: grades ``/autograder/submission`` with ``cli.grade --tiers course`` and always
writes ``/autograder/results/results.json``, also when grading itself fails), ``finish.py`` (writes that
file, standard library only) and ``suite/``, this suite's tracked files.

``run_autograder`` reads its places from the environment, so it can run outside Gradescope:
``AUTOGRADER_ROOT`` (``/autograder``), ``CS336_PYTHON`` (the interpreter that grades; default the
virtualenv ``setup.sh`` made), ``CS336_GRADE_ARGS`` (more arguments for ``cli.grade``, e.g. ``-- -k ddp``)
and ``CS336_GRADE_TIMEOUT`` (seconds, 3000).
"""

from __future__ import annotations

import subprocess
import sys
import zipfile
from pathlib import Path

from cs336_systems.cli.common import Parser, check_outputs

SUITE = Path(__file__).resolve().parents[3]
GRADER_USER = "cs336-student"
# The help names no file of the zip by its name: they are written, not files of the repository.
DESCRIPTION = """Build Gradescope's autograder zip: its setup script (run once, when Gradescope builds the image)
installs the suite with its pinned torch and Triton and adds the unprivileged user the graded code runs as;
run_autograder grades /autograder/submission (course tier) and always writes results/results.json there.

run_autograder reads AUTOGRADER_ROOT (/autograder), CS336_PYTHON (the grading interpreter), CS336_GRADE_ARGS
(more cli.grade arguments, e.g. "-- -k ddp") and CS336_GRADE_TIMEOUT (seconds, 3000)."""

SETUP_SH = f"""#!/usr/bin/env bash
# Gradescope runs this once, as root, when it builds the autograder's image.
set -euxo pipefail
SOURCE=${{AUTOGRADER_ROOT:-/autograder}}/source
apt-get update -qq && apt-get install -y -qq python3 python3-venv python3-pip
python3 -m venv "$SOURCE/venv"
# The suite pins torch and Triton (pyproject.toml); the graded code runs with the same versions.
"$SOURCE/venv/bin/pip" install -q "$SOURCE/suite[test]"
# The graded code runs as this user: it cannot write the grader's files or the results.
id {GRADER_USER} >/dev/null 2>&1 || useradd --system --create-home --shell /usr/sbin/nologin {GRADER_USER}
"""

RUN_AUTOGRADER = f"""#!/usr/bin/env bash
# Gradescope runs this per submission. Whatever happens, results/results.json is written.
set -u
ROOT=${{AUTOGRADER_ROOT:-/autograder}}
SOURCE=$ROOT/source
PYTHON=${{CS336_PYTHON:-$SOURCE/venv/bin/python}}
WORK=$(mktemp -d)
START=$(date +%s)
mkdir -p "$ROOT/results"
USER_OPTION=()
# The graded code runs as the unprivileged user where the grader supports it and the user exists.
if id {GRADER_USER} >/dev/null 2>&1 && \\
    (cd "$SOURCE/suite" && PYTHONPATH=src "$PYTHON" -m cs336_systems.cli.grade --help 2>/dev/null) | grep -q -- --worker-user; then
    USER_OPTION=(--worker-user {GRADER_USER})
fi
# CS336_GRADE_ARGS is split on purpose: it holds several arguments (e.g. "-- -k ddp").
(cd "$SOURCE/suite" && PYTHONPATH=src timeout "${{CS336_GRADE_TIMEOUT:-3000}}" "$PYTHON" -m cs336_systems.cli.grade \\
    "$ROOT/submission" --out "$WORK/grade" --tiers course "${{USER_OPTION[@]}}" ${{CS336_GRADE_ARGS:-}}) \\
    >"$WORK/grade.log" 2>&1
RC=$?
cat "$WORK/grade.log"
"$PYTHON" "$SOURCE/finish.py" "$WORK/grade/submission/results.json" "$WORK/grade.log" "$RC" "$START" \\
    "$ROOT/results/results.json" || \\
    printf '%s' '{{"score": 0, "output": "the autograder failed before it could grade", "tests": []}}' \\
    >"$ROOT/results/results.json"
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


def suite_files(root: Path = SUITE) -> list[str]:
    """The suite's tracked files (what a fresh clone has), relative to ``root``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    if listed.returncode != 0:
        raise SystemExit(f"autograder: {root} is not a git checkout; cannot tell the suite's files")
    return [f for f in listed.stdout.decode().split("\0") if f and (root / f).is_file()]


def build(out: Path, root: Path = SUITE) -> Path:
    """Write the autograder zip to ``out``."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in (("setup.sh", SETUP_SH), ("run_autograder", RUN_AUTOGRADER)):
            info = zipfile.ZipInfo(name)
            info.external_attr = 0o755 << 16  # executable once unzipped: Gradescope runs them directly
            zf.writestr(info, text)
        zf.writestr("finish.py", FINISH_PY)
        for name in suite_files(root):
            zf.write(root / name, f"suite/{name}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser("autograder", description=DESCRIPTION)
    p.add_argument("--out", type=Path, default=Path("autograder.zip"), help="the zip to write")
    args = p.parse_args(argv)
    check_outputs(p, {"--out": (args.out, False)})
    build(args.out)
    print(f"autograder: wrote {args.out} (upload it as the autograder's zip; setup.sh installs the suite)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
