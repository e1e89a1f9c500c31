"""Build Gradescope's autograder: ``python -m cs336_systems.cli.autograder --out autograder.zip``.

The zip holds what Gradescope takes: ``setup.sh`` (run once when the image is built: a Python the suite
runs on, a virtualenv with the suite under ``requirements/pins.txt`` (the pins tox installs) and the
students' dependencies, an unprivileged user for the graded code), ``run_autograder`` (run per
submission: grades ``/autograder/submission`` with ``cli.grade --tiers course`` and always writes
``/autograder/results/results.json``, also when grading itself fails), ``finish.py`` (writes that file,
standard library only), ``student-deps.txt`` (``requirements/students.txt`` and ``--student-deps``) and
``suite/``, this suite's tracked files. The scripts are ``grading/gradescope_zip.py``.

``run_autograder`` reads its places from the environment, so it can run outside Gradescope:
``AUTOGRADER_ROOT`` (``/autograder``), ``CS336_PYTHON`` (the interpreter that grades; default the
virtualenv ``setup.sh`` made), ``CS336_WORKER_USER`` (the user the graded code runs as; default
``cs336-student`` where it exists, empty for the grader's own), ``CS336_GRADE_ARGS`` (more arguments
for ``cli.grade``, e.g. ``-- -k ddp``) and ``CS336_GRADE_TIMEOUT`` (seconds, 3000); ``setup.sh`` reads
``AUTOGRADER_ROOT``, ``CS336_SETUP_PYTHON`` (the interpreter to build on) and ``CS336_TORCH_INDEX``
(default: torch's CPU wheels; "none": pip's own configuration only).
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

from cs336_systems.cli.common import Parser, check_outputs
from cs336_systems.grading.gradescope_zip import FINISH_PY, RUN_AUTOGRADER, SETUP_SH, render

SUITE = Path(__file__).resolve().parents[3]
GRADER_USER = "cs336-student"
STUDENT_DEPS = Path("requirements") / "students.txt"
# A requirement a TA adds: a distribution name, optional extras and version specifiers; nothing pip would
# read as an option or a path (a line of student-deps.txt).
_VERSION = r"\s*(?:===?|[<>!~]=|[<>])\s*[\w.*+!-]+"
REQUIREMENT = re.compile(rf"[A-Za-z0-9][\w.-]*(?:\[[\w,.-]+\])?(?:{_VERSION}(?:\s*,{_VERSION})*)?")
# The help names no file of the zip by its name: they are written, not files of the repository.
DESCRIPTION = """Build Gradescope's autograder zip: its setup script (run once, when Gradescope builds the image;
pick the Ubuntu 24.04 base, whose python3 is 3.12: on 22.04 it installs a newer Python first) installs the
suite under the pins tox installs (requirements/pins.txt: torch from its CPU wheels, Triton, numpy),
the students' dependencies (requirements/students.txt and --student-deps), and adds the
unprivileged user the graded code runs as; run_autograder grades /autograder/submission (course tier) and
always writes results/results.json there.

run_autograder reads AUTOGRADER_ROOT (/autograder), CS336_PYTHON (the grading interpreter), CS336_WORKER_USER
(the user the graded code runs as: cs336-student where it exists; empty: the grader's), CS336_GRADE_ARGS
(more cli.grade arguments, e.g. "-- -k ddp") and CS336_GRADE_TIMEOUT (seconds, 3000); the setup script
reads AUTOGRADER_ROOT, CS336_SETUP_PYTHON (the interpreter to build on) and CS336_TORCH_INDEX ("none": pip's
own configuration only)."""


def suite_files(root: Path = SUITE) -> list[str]:
    """The suite's tracked files (what a fresh clone has), relative to ``root``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, timeout=60)
    if listed.returncode != 0:
        raise SystemExit(f"autograder: {root} is not a git checkout; cannot tell the suite's files")
    return [f for f in listed.stdout.decode().split("\0") if f and (root / f).is_file()]


def python_floor(root: Path = SUITE) -> tuple[int, int]:
    """The oldest Python the suite runs on, from ``requires-python`` (``>=3.11``): setup.sh looks for it."""
    spec = tomllib.loads((root / "pyproject.toml").read_text())["project"]["requires-python"]
    found = re.fullmatch(r"\s*>=\s*(\d+)\.(\d+)\s*", spec)
    if found is None:
        raise SystemExit(f"autograder: requires-python {spec!r} is not of the form '>=3.N'")
    return int(found[1]), int(found[2])


def student_deps(root: Path = SUITE, extra: list[str] | tuple[str, ...] = ()) -> str:
    """``student-deps.txt``: the course's dependencies (``requirements/students.txt``), then ``extra``."""
    bad = [spec for spec in extra if not REQUIREMENT.fullmatch(spec)]
    if bad:
        raise ValueError(f"not a requirement (a name, optionally a version: einx, 'einx>=0.4'): {bad}")
    base = (root / STUDENT_DEPS).read_text()
    added = "".join(f"{spec}\n" for spec in extra)
    return base + (f"# added with --student-deps\n{added}" if added else "")


def scripts(root: Path = SUITE) -> dict[str, str]:
    """The zip's scripts, their slots filled: the grader's user and the suite's oldest Python."""
    major, minor = python_floor(root)
    slots = {"USER": GRADER_USER, "MIN": f"{major}.{minor}", "MIN_TUPLE": f"{major}, {minor}"}
    return {
        "setup.sh": render(SETUP_SH, slots),
        "run_autograder": render(RUN_AUTOGRADER, slots),
        "finish.py": FINISH_PY,
    }


def build(out: Path, root: Path = SUITE, extra_deps: list[str] | tuple[str, ...] = ()) -> Path:
    """Write the autograder zip to ``out``; ``extra_deps`` are requirements the graded code needs beyond
    ``requirements/students.txt``."""
    deps = student_deps(root, extra_deps)
    out.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for name, text in scripts(root).items():
            info = zipfile.ZipInfo(name)
            if name != "finish.py":
                info.external_attr = 0o755 << 16  # executable once unzipped: Gradescope runs them directly
            zf.writestr(info, text)
        zf.writestr("student-deps.txt", deps)
        for name in suite_files(root):
            zf.write(root / name, f"suite/{name}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = Parser("autograder", description=DESCRIPTION)
    p.add_argument("--out", type=Path, default=Path("autograder.zip"), help="the zip to write")
    p.add_argument(
        "--student-deps",
        nargs="+",
        action="extend",
        default=[],
        metavar="REQ",
        help="more packages the graded code imports, installed beside requirements/students.txt "
        "(e.g. --student-deps wandb 'einx>=0.4')",
    )
    args = p.parse_args(argv)
    check_outputs(p, {"--out": (args.out, False)})
    try:
        build(args.out, extra_deps=args.student_deps)
    except ValueError as exc:
        p.error(f"--student-deps: {exc}")
    print(f"autograder: wrote {args.out} (upload it as the autograder's zip; base image: Ubuntu 24.04)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
