"""``docs/results`` as its README states it (issue 57: 9.0 MB in 54 files, folders named after the working
session that wrote them): under 5 MB, every file listed in the folder's index with what it holds, every
``docs/results/...`` path a doc names present, no name that says which session produced it."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "docs" / "results"
INDEX = RESULTS / "README.md"
MAX_BYTES = 5_000_000
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a path a doc names (`git show REV:docs/results/...` names history, not the tree: the lookbehind skips it)
NAMED = re.compile(r"(?<![\w/:.])docs/results/[\w./*{},-]*")
SESSION_NAME = re.compile(r"session\d|call\d", re.IGNORECASE)


def _files() -> list[str]:
    return sorted(p.relative_to(RESULTS).as_posix() for p in RESULTS.rglob("*") if p.is_file())


def _expand(pattern: str) -> list[str]:
    """``a.{json,log}`` -> ``a.json``, ``a.log`` (the docs' shorthand for files of one run)."""
    parts = re.split(r"\{([^}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def test_the_folder_stays_under_5_mb() -> None:
    total = sum(p.stat().st_size for p in RESULTS.rglob("*") if p.is_file())
    assert total < MAX_BYTES, f"docs/results holds {total / 1e6:.2f} MB"


def test_every_file_is_in_the_index_and_every_indexed_file_exists() -> None:
    listed = set(re.findall(r"^\| `([^`]+)` \|", INDEX.read_text(), re.MULTILINE))
    files = set(_files()) - {"README.md"}
    assert not files - listed, f"files the index does not describe: {sorted(files - listed)}"
    assert not listed - files, f"indexed files that are gone: {sorted(listed - files)}"


def test_every_results_path_a_doc_names_exists() -> None:
    missing = []
    for doc in DOCS:
        for named in NAMED.findall(doc.read_text()):
            named = named.rstrip(".,")
            if not any(list(ROOT.glob(p)) or (ROOT / p).exists() for p in _expand(named)):
                missing.append(f"{doc.relative_to(ROOT)}: {named}")
    assert not missing, missing


def test_no_name_says_which_session_made_it() -> None:
    named = [p for p in _files() if SESSION_NAME.search(p)]
    assert not named, named


def test_the_checks_see_what_they_guard(tmp_path: Path) -> None:
    """Each check can fail: a brace pattern expands, a history path is skipped, a session name is seen."""
    assert _expand("docs/results/x.{json,log}") == ["docs/results/x.json", "docs/results/x.log"]
    text = "`git show 7c91a61:docs/results/traces/a.json.gz` and `docs/results/gone.json`."
    assert [n.rstrip(".,") for n in NAMED.findall(text)] == ["docs/results/gone.json"]
    assert SESSION_NAME.search("session22/h100-call8-proxy-8b.json") and not SESSION_NAME.search(
        "proxy-8b/h100-2026-11-26.json"
    )
