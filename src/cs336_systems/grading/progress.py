"""A repository's ``progress.jsonl``: what its grading has done and what runs now, read by the class run
for a repository's progress line (and, after a grading that did not finish, for its partial results).

Two kinds of lines. A case line per graded case (``case``, ``hook``, ``tier``, ``status``, the seconds),
written by the judge's ``Recorder`` as each verdict is made. A phase line (``phase``: ``start`` or
``end``, a ``key``, what it is in words, when) as something that takes time starts or ends: a job of
the graded code (a family's cases at a world size; the same key again when it runs once more or a case
runs alone), the course's tests, the leaderboard row. Readers of case lines skip the phase lines.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from .shared.cases import CASES

START, END = "start", "end"
_WRITING = threading.Lock()  # the judge's job threads and its verdict loop write the one file
STARTING = "loading its code and starting its first workers"


def append(path: Path | None, line: dict) -> None:
    if path is None:
        return
    with _WRITING, path.open("a") as f:
        f.write(json.dumps(line) + "\n")


def phase(path: Path | None, state: str, key: str, doing: str) -> None:
    append(path, {"phase": state, "key": key, "doing": doing, "at": round(time.time(), 1)})


def job_words(batch: list[str], world_size: int) -> str:
    """A job of the graded code in words: its family, tiers and world size, and how many cases."""
    cases = [CASES[c] for c in batch if c in CASES]
    families = ", ".join(dict.fromkeys(c.family for c in cases)) or "cases"
    tiers = ", ".join(dict.fromkeys(c.tier for c in cases))
    ranks = f" at {world_size} ranks" if world_size > 1 else ""
    what = f"{len(batch)} cases" if len(batch) > 1 else batch[0]
    return f"{families}{ranks} ({tiers}): {what}"


def _lines(path: Path) -> list[dict]:
    try:
        text = path.read_text() if path.is_file() else ""
    except OSError:
        return []
    found = []
    for line in text.splitlines():
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written as it is read
            continue
    return found


def case_lines(path: Path) -> list[dict]:
    return [line for line in _lines(path) if "case" in line]


def running(path: Path) -> dict[str, dict]:
    """The phases started and not ended, by key: the latest words and the first start's time."""
    now: dict[str, dict] = {}
    for line in _lines(path):
        if line.get("phase") == START:
            began = now.get(line["key"], line).get("at", line.get("at"))
            now[line["key"]] = {"doing": line.get("doing", ""), "at": began}
        elif line.get("phase") == END:
            now.pop(line.get("key"), None)
    return now


def progress_line(path: Path) -> str:
    """What a running repository's grading has done so far and what runs now."""
    cases, now = case_lines(path), running(path)
    last = cases[-1] if cases else None
    done = f"{len(cases)} cases done, last {last['hook']} {last['tier']} ({last['status']})" if last else ""
    if not now:
        return done or STARTING
    shown = [f"{p['doing']} for {max(0.0, time.time() - p['at']):.0f} s" for p in list(now.values())[:2]]
    more = f" and {len(now) - 2} more" if len(now) > 2 else ""
    return (f"{done}; " if done else "") + "now: " + "; ".join(shown) + more


def partial_report(path: Path) -> dict | None:
    """The cases a run that did not finish had graded (no messages: the progress lines carry none)."""
    if not path.is_file():
        return None
    cases = [
        {"id": row["case"], "tier": row["tier"], "hooks": [row["hook"]], "status": row["status"]}
        | {"kind": "", "message": ""}
        for row in case_lines(path)
    ]
    return {"cases": cases, "seed": None}
