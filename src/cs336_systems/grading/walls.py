"""What the walls around the graded code hold, probed rather than assumed, and a tripwire behind them.

``probe`` starts a process exactly as a worker starts (the same ``Sandbox``: namespaces, mounts, user)
and has it try to write each sensitive place of this machine (a neighbour's tree, the grading
interpreter's ``site-packages`` and standard library, the suite, the results, the grader's ``HOME``, its
compile caches, ``/tmp`` and ``/dev/shm``); whether a place held is read from outside, on the real
filesystem (a file the probe wrote inside its private ``/tmp`` is not a hole). ``grade.json`` records the
answer, and a class does not start where a neighbour or the grading environment stays writable unless
the TA accepts that risk by name.

``Tripwire`` is the layer behind the walls: a listing with sizes and change times of the grading
environment, the suite's code and every repository's tree, taken before the class and again as each
repository ends. A change means some graded code wrote outside its scratch; the class stops there,
before another repository is graded on a changed environment. The grading processes write no bytecode
(``PYTHONDONTWRITEBYTECODE``), so a new ``.pyc`` is never the grader's own.
"""

from __future__ import annotations

import importlib.util
import json
import marshal
import os
import re
import secrets
import site
import subprocess
import sys
import sysconfig
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from . import caches
from .roots import SUITE_SRC, GradingSetupError, discover
from .sandbox import JobFolder, Sandbox, jobs_parent

HELD, WRITABLE = "held", "writable"
# A class refuses to start while one of these stays writable (one repository could change another's
# grade, or every later grade); the others are recorded and shown.
CLASS_RISKS = ("neighbour", "grading environment", "suite")
MARKER = ".cs336-wall-"
TOKEN_BYTES = 8  # of a probe's marker name: MARKER and 2 * TOKEN_BYTES hex digits

PROBE = """
import json, os, sys
places, out, token = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
seen = {}
for name, path in places:
    try:
        seen[name] = bool(os.listdir(path))  # a covered folder is there, and empty
    except OSError:
        seen[name] = False
    try:
        fd = os.open(os.path.join(path, ".cs336-wall-" + token), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        os.close(fd)
    except OSError:
        pass
with open(os.path.join(out, "seen.json"), "w") as f:
    json.dump(seen, f)
"""


@dataclass(frozen=True)
class Place:
    kind: str  # "neighbour", "grading environment", "suite", "results", "home", "cache", "tmp"
    path: Path

    @property
    def name(self) -> str:
        return f"{self.kind}: {self.path}"


def grading_environment(existing: bool = True) -> list[Path]:
    """The grading interpreter's packages and standard library, and the user's site-packages where it
    reads them (outside a virtual environment): a ``.pth`` or a patched module there runs in every later
    grading process. ``existing``: only the folders there now (what a probe can write into; the
    tripwire also lists one created later)."""
    paths = sysconfig.get_paths()
    found = [Path(paths[k]) for k in ("purelib", "platlib", "stdlib", "platstdlib") if k in paths]
    if site.ENABLE_USER_SITE:
        found.append(Path(site.getusersitepackages()))
    return [p for p in dict.fromkeys(p.resolve() for p in found) if p.is_dir() or not existing]


def suite_code() -> list[Path]:
    """The suite's package: the judge's and the workers' own code."""
    return [SUITE_SRC] if SUITE_SRC.is_dir() else []


def places(neighbours: list[Path], results: list[Path]) -> list[Place]:
    """Every place a worker must not write, on this machine."""
    home = Path(os.path.expanduser("~"))
    caches = [home / ".triton" / "cache", home / ".cache", Path(tempfile.gettempdir())]
    found = [Place("neighbour", p) for p in neighbours]
    found += [Place("grading environment", p) for p in grading_environment()]
    found += [Place("suite", p) for p in suite_code()]
    found += [Place("results", p) for p in results]
    found += [Place("home", home), *(Place("cache", p) for p in caches[:2])]
    found += [Place("tmp", caches[2]), Place("tmp", Path("/dev/shm"))]
    return [p for p in found if p.path.is_dir()]


def probe(sandbox: Sandbox, where: list[Place]) -> dict[str, str]:
    """Each place's name -> "held" or "writable", as a worker of ``sandbox`` finds it (a neighbour it can
    see but not write is "held, visible")."""
    token = secrets.token_hex(TOKEN_BYTES)
    job = JobFolder.make(jobs_parent(), prefix="walls-")
    try:
        sandbox.prepare(job)
        code = [sys.executable, "-I", "-S", "-c", PROBE, json.dumps([[p.name, str(p.path)] for p in where])]
        cmd = sandbox.wrap([*code, str(job.out), token], job, [], job.path)
        env = {**os.environ, **sandbox.env()}
        subprocess.run(cmd, cwd=job.path, env=env, capture_output=True, timeout=60)
        seen = _read_seen(job.out / "seen.json")
    finally:
        job.remove()
    found = {}
    for place in where:
        marker = place.path / f"{MARKER}{token}"
        wrote = marker.exists()
        marker.unlink(missing_ok=True)
        visible = place.kind == "neighbour" and seen.get(place.name, True)
        found[place.name] = WRITABLE if wrote else f"{HELD}, visible" if visible else HELD
    return found


def _read_seen(path: Path) -> dict[str, bool]:
    try:
        seen = json.loads(path.read_text())
        return {str(k): bool(v) for k, v in seen.items()} if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        return {}


def holes(found: dict[str, str], kinds: tuple[str, ...] = CLASS_RISKS) -> list[str]:
    """The places of ``kinds`` that stayed writable."""
    return [name for name, state in found.items() if state == WRITABLE and name.split(":")[0] in kinds]


def describe(found: dict[str, str]) -> str:
    """One line for the CLI."""
    writable = [n for n, s in found.items() if s == WRITABLE]
    visible = [n for n, s in found.items() if s.endswith("visible")]
    if not writable:
        line = f"walls: the graded code wrote none of the {len(found)} places probed"
    else:
        line = (
            f"walls: the graded code can WRITE {len(writable)} of {len(found)} places: {', '.join(writable)}"
        )
    return line + (f"; it can see {', '.join(visible)}" if visible else "")


@dataclass
class Tripwire:
    """Listings of ``roots`` (path -> size and change time) taken now and compared later. The change
    time (``st_ctime``), not the modification time: a write, a ``chmod`` or an ``os.utime`` sets it to
    now, and no unprivileged process can set it back (code that rewrote a file and restored its
    modification time would pass a listing of ``st_mtime``)."""

    roots: list[Path]
    before: dict[str, tuple[int, int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.before = self.listing()

    def listing(self) -> dict[str, tuple[int, int]]:
        found: dict[str, tuple[int, int]] = {}
        for root in self.roots:
            _walk(root, found)
        return found

    def changed(self) -> list[str]:
        """The paths added, removed or modified since the listing was taken, sorted; bytecode that is
        exactly its unchanged source compiled (another process imported a module) is not a change."""
        now = self.listing()
        keys = set(now) | set(self.before)
        moved = [k for k in keys if now.get(k) != self.before.get(k)]
        return sorted(k for k in moved if not (k in now and compiled_from_source(Path(k))))


def compiled_from_source(pyc: Path) -> bool:
    """Whether ``pyc`` is what Python itself writes for its source: the header names the source's
    current size and time, and the code is the source compiled (a planted ``.pyc`` is not)."""
    if pyc.suffix != ".pyc" or pyc.parent.name != "__pycache__":
        return False
    source = pyc.parent.parent / f"{pyc.name.split('.')[0]}.py"
    try:
        data, st = pyc.read_bytes(), source.stat()
        flags, mtime, size = (int.from_bytes(data[i : i + 4], "little") for i in (4, 8, 12))
        if data[:4] != importlib.util.MAGIC_NUMBER or flags != 0:
            return False
        if mtime != int(st.st_mtime) & 0xFFFFFFFF or size != st.st_size & 0xFFFFFFFF:
            return False
        return marshal.loads(data[16:]) == compile(
            source.read_bytes(), str(source), "exec", dont_inherit=True
        )
    except (OSError, ValueError, EOFError, TypeError, SyntaxError):
        return False


# The probe's own markers come and go while a class runs (where it accepted writable walls): exactly
# these names, never a ``.pth`` or a folder named like them.
IN_FLIGHT = re.compile(re.escape(MARKER) + f"[0-9a-f]{{{2 * TOKEN_BYTES}}}")
# Of a git folder, what git runs code from when the TA next pulls (hooks, and config's ``core.hooksPath``
# or ``core.fsmonitor``); its objects and index change under any git command.
GIT_RUNS = ("config", "hooks")


def _walk(root: Path, found: dict[str, tuple[int, int]]) -> None:
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            if entry.name == ".git" and entry.is_dir(follow_symlinks=False):
                for name in GIT_RUNS:
                    path = os.path.join(entry.path, name)
                    if os.path.isdir(path):
                        stack.append(path)
                    else:
                        _record(path, found)
            elif entry.is_dir(follow_symlinks=False):
                stack.append(entry.path)  # its files say what changed; its own time only that something did
            elif not (IN_FLIGHT.fullmatch(entry.name) and entry.is_file(follow_symlinks=False)):
                _record(entry.path, found)


def _record(path: str, found: dict[str, tuple[int, int]]) -> None:
    try:
        st = os.lstat(path)
    except OSError:
        return
    found[path] = (st.st_size, st.st_ctime_ns)


def trees(target: Path) -> list[Path]:
    """The folders of a class's target (a repository, or an adapters file): its root, its package's and
    its ``cs336_basics``'s (which may lie outside it)."""
    adapters = target / "tests" / "adapters.py" if target.is_dir() else target
    try:
        return discover(adapters).folders()
    except GradingSetupError:  # not a repository the grader can read: its folder, where it is one
        return [target] if target.is_dir() else []


def watched(repos: list[Path]) -> list[Path]:
    """What the class's tripwire lists: the grading environment, the suite's code, the compile caches'
    seed, each repository's folders (nested ones once)."""
    seeded = [seed] if (seed := caches.seed()) is not None else []
    found = [
        *grading_environment(existing=False),
        *suite_code(),
        *seeded,
        *(p for target in repos for p in trees(target)),
    ]
    folders = sorted({p.resolve() for p in found}, key=lambda p: len(p.parts))
    return [p for i, p in enumerate(folders) if not any(p.is_relative_to(q) for q in folders[:i])]
