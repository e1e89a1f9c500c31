"""The class report of a class run's folder: ``class.md``, ``class.csv`` and ``class.html`` (one
self-contained page, its chart inlined), and ``leaderboard.png``.

Repositories x hook groups, each cell the group's verdict (course, then the tiers that fail); a
repository that could not be graded is a row saying why. Under the table, the cases a repository's
machine could not run (no GPU there, a kernel that refuses CPU tensors, an overloaded machine), one
line per reason and hook group, not one per case id. The leaderboard ranks the repositories' rows
on the parent's clock (``repo/leaderboard/row.py``), the course's own figure (``do_bench`` mean in the graded
process) beside it, with the suite's kernel and cuDNN timed the same way on each model of GPU; a row that
breaks a rule of ``repo/leaderboard/standing.py`` gets no rank and says why.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
import textwrap
from collections import Counter
from pathlib import Path
from typing import Any

from ..leaderboard_row import LeaderboardRow
from ..probe import ALL_HOOKS
from ..repo.leaderboard.standing import order
from ..shared.cases import CASES, NEEDS_GPU, REFUSES_CPU, TIERS, UNFINISHED_HERE
from .course_report import COURSE_NOTE, COURSE_TITLE, agreement_summary, course_table


def load(path: Path) -> Any:
    try:
        return json.loads(path.read_text()) if path.is_file() else None
    except json.JSONDecodeError:
        return None


def collect(out: Path, names: list[str]) -> dict[str, dict]:
    """Per repository: its report (or None), why grading failed (or None), its leaderboard row."""
    found = {}
    for name in names:
        folder = out / name
        failure = folder / "failure.txt"
        results = load(folder / "results.json") or {}
        found[name] = {
            "report": load(folder / "grade.json"),
            "failure": failure.read_text().strip() if failure.is_file() else None,
            "leaderboard": load(folder / "leaderboard.json"),
            "score": results.get("score"),
            "max_score": _max_score(results),
            "unscored": _unscored(results),
        }
    return found


def _max_score(results: dict) -> float | None:
    """The points a repository's results.json offers: the sum of its tests' max_score (per repository:
    the editions have different hooks)."""
    tests = results.get("tests") if isinstance(results, dict) else None
    tops = [t.get("max_score") for t in tests or [] if isinstance(t, dict)]
    numbers = [x for x in tops if isinstance(x, int | float) and not isinstance(x, bool)]
    return round(sum(numbers), 4) if numbers else None


def _unscored(results: dict) -> dict[str, int]:
    """The cases that would carry points but are out of the score (``gradescope._unscored``), by why."""
    extra = results.get("extra_data") if isinstance(results, dict) else None
    found = extra.get("unscored") if isinstance(extra, dict) else None
    if not isinstance(found, dict):
        return {}
    return {str(k): n for k, n in found.items() if isinstance(n, int) and not isinstance(n, bool) and n > 0}


def score_text(results: dict) -> str:
    """``27.5 / 30``, and the cases out of it: ``25 / 25, 2 cases not run here``; ``-``: no score."""
    r = {"score": results.get("score"), "max_score": _max_score(results), "unscored": _unscored(results)}
    return _score(r)


def anchors(out: Path) -> list[dict]:
    """The suite's kernel and cuDNN, timed as the students' rows are, once per model of GPU."""
    rows = []
    for path in sorted((out / "anchors").glob("gpu*.json")):
        data = load(path) or {}
        for row in data.get("rows", []) if isinstance(data, dict) else []:
            read = LeaderboardRow.read(row)
            if read is not None and read.parent_ms is not None:
                rows.append({"name": str(row.get("name")), "row": read, "at": path.stem})
    return rows


NOT_GRADED_WIDTH = 160  # a failure's message in a table cell, cut at a word; failure.txt keeps it whole
NO_SCORE = (
    "`-`: no score: the repository could not be graded (its row says why; the whole message is in "
    "`<repository>/failure.txt`)."
)
NO_GROUP = (
    "`—`: no case of that hook group was graded for the repository: its edition of the hooks has none (or "
    "the selection, `--tiers` or `-k`, took none of its cases)."
)
SCORE_NOTE = (
    "Score: the points earned / the points its results.json offers (the editions have different hooks)"
)
UNSCORED_NOTE = (
    "; cases `not run here` (no GPU where graded, a kernel that refuses CPU tensors, a machine too busy) "
    "or that `could not be graded` (a dependency missing from the grading environment) are out of both, "
    "and named."
)


def legend(rows: list[list[str]]) -> str:
    """What the table's marks mean: only those that appear in it."""
    cells = [c for row in rows for c in row[2:]]
    parts = [NO_SCORE] if any(row[1] == "-" for row in rows) else []
    parts += [NO_GROUP] if "—" in cells else []
    unscored = any("," in row[1] for row in rows)
    return " ".join([*parts, SCORE_NOTE + (UNSCORED_NOTE if unscored else ".")])


NOT_RUN_WHY = {  # a skip of the machine, not of the code: no verdict, no points
    NEEDS_GPU: "not run: needs a CUDA GPU, none where graded",
    REFUSES_CPU: "not run: the Triton kernel refuses CPU tensors, no GPU where graded",
    UNFINISHED_HERE: "not run: the machine could not finish it (overloaded, or a connection lost)",
}
INTERPRETED = "run on the CPU under Triton's interpreter, no GPU where graded (verdicts in the cells above)"
NOT_RUN_TITLE = "What the grading machine could not run as written"
NOT_RUN_NOTE = (
    "A case id (in `<repository>/grade.json` and `results.json`) ends in the device the case is written "
    "for. Where no GPU is, a `-cuda` case small enough runs on the CPU under Triton's interpreter; the "
    "others are not run, and have no verdict and no points. Per reason and hook group, the cases of "
    "each tier:"
)


def _score(r: dict) -> str:
    if not isinstance(r["score"], int | float):
        return "-"
    shown = (
        f"{r['score']:g} / {r['max_score']:g}"
        if isinstance(r.get("max_score"), int | float)
        else f"{r['score']:g}"
    )
    out = [f"{n} {'case' if n == 1 else 'cases'} {why}" for why, n in (r.get("unscored") or {}).items()]
    return ", ".join([shown, *out])


def _groups(repos: dict[str, dict]) -> list[str]:
    return [
        g for g in ALL_HOOKS if any(g in ((r["report"] or {}).get("groups") or {}) for r in repos.values())
    ]


def hook_table(repos: dict[str, dict], whole: bool = False) -> tuple[list[str], list[list[str]]]:
    """Repositories x hook groups, every row as wide as the header; a repository that could not be
    graded says why in its first group's cell (cut at a word unless ``whole``)."""
    groups = _groups(repos)
    columns = groups or ["grading"]  # no repository graded: one column for the reasons
    header = ["repository", "score", *columns]
    rows = []
    for name, r in repos.items():
        if r["report"] is None:
            why = r["failure"] or "cannot grade: no report"
            shown = why if whole else textwrap.shorten(why, NOT_GRADED_WIDTH, placeholder=" ...")
            rows.append([name, "-", shown, *["" for _ in columns[1:]]])
            continue
        got = r["report"]["groups"]
        rows.append([name, _score(r), *[got[g]["verdict"] if g in got else "—" for g in groups]])
    return header, rows


def csv_rows(repos: dict[str, dict]) -> list[list[str]]:
    """The hook table for a spreadsheet: score and maximum in columns of their own, messages whole."""
    header, rows = hook_table(repos, whole=True)
    # The columns that would be empty in every row are left out (a run with no --course-tests, ...).
    course = any(r["report"] and "course_tests" in r["report"] for r in repos.values())
    unscored = any(r["report"] and r.get("unscored") for r in repos.values())
    out = [[header[0], "score", "max_score", *header[2:]]]
    out[0] += [*(["not in the score"] if unscored else []), *(["course tests"] if course else [])]
    for (name, *cells), r in zip(rows, repos.values(), strict=True):
        score = f"{r['score']:g}" if isinstance(r["score"], int | float) and r["report"] else ""
        top = f"{r['max_score']:g}" if isinstance(r.get("max_score"), int | float) and r["report"] else ""
        out.append([name, score, top, *cells[1:]])
        out[-1] += [", ".join(f"{n} {why}" for why, n in r["unscored"].items())] if unscored else []
        out[-1] += [agreement_summary(r["report"])] if course else []
    return out


def _compile_failure(error: object) -> str:
    """The exception's names alone (``InductorError: CompilationError``): the whole message, often a page of
    the student's kernel, is in ``leaderboard.json`` and in the leaderboard tier's compile case."""
    text = str(error or "compile failed")
    names = re.match(r"(\w+(?:Error|Exception)(?:: \w+(?:Error|Exception))*)", text)
    return names.group(1) if names else text[:80]


def _why_not_run(case: dict, no_gpu: bool) -> str | None:
    """Why the machine did not run ``case`` (or ran it on its CPU in place of a GPU); None: it ran."""
    if case.get("status") == "skipped":
        return NOT_RUN_WHY.get(case.get("kind"))
    known = CASES.get(case.get("id"))
    if no_gpu and case.get("status") in ("passed", "failed") and known and known.device == "cuda":
        return INTERPRETED
    return None


def not_run(repos: dict[str, dict]) -> list[str]:
    """One line per reason and hook group: the cases per tier, and the repositories with those counts
    (a ``needs-gpu`` skip says its machine had no GPU: its ``-cuda`` cases that ran were interpreted)."""
    found: dict[tuple[str, str], dict[str, Counter]] = {}  # (why, hook group) -> repository -> tiers
    for name, r in repos.items():
        cases = (r["report"] or {}).get("cases") or []
        no_gpu = any(c.get("kind") == NEEDS_GPU for c in cases)
        for c in cases:
            if c.get("hooks") and (why := _why_not_run(c, no_gpu)):
                found.setdefault((why, c["hooks"][0]), {}).setdefault(name, Counter())[c["tier"]] += 1
    reasons = [*NOT_RUN_WHY.values(), INTERPRETED]
    rank = lambda key: (reasons.index(key[0]), ALL_HOOKS.index(key[1]) if key[1] in ALL_HOOKS else 99)
    graded = [n for n, r in repos.items() if r["report"] is not None]
    lines = []
    for why, group in sorted(found, key=rank):
        alike: dict[str, list[str]] = {}  # the tiers' counts -> the repositories with those
        for name, tiers in found[why, group].items():
            alike.setdefault(", ".join(f"{t} {tiers[t]}" for t in TIERS if tiers[t]), []).append(name)
        for counts, names in alike.items():
            where = "every graded repository" if len(names) > 1 and names == graded else ", ".join(names)
            lines.append(f"- {why}: {group}: {counts} (in {where})")
    return lines


def leaderboard(repos: dict[str, dict], anchor_rows: list[dict]) -> list[dict]:
    """Ranked rows (observed before self-reported, fastest first), then unranked ones with their
    reason, then the references."""
    rows = []
    for name, r in repos.items():
        lb = LeaderboardRow.read(r["leaderboard"])
        if lb is None:
            continue
        how = "compiled" if lb.compiled else f"eager ({_compile_failure(lb.compile_error)})"
        rows.append(_board_row(name, lb, how))
    ranked = order([r for r in rows if r["ranked"]])
    for i, r in enumerate(ranked, 1):
        r["rank"] = str(i)
    unranked = [dict(r, rank="no rank") for r in rows if not r["ranked"]]
    refs = [_board_row(a["name"], a["row"], f"on {a['at']}", reference=True) for a in anchor_rows]
    return ranked + unranked + refs


def _board_row(name: str, lb: LeaderboardRow, how: str, reference: bool = False) -> dict:
    """A line of the ranking, from the row its repository's job wrote (or a reference's)."""
    return {
        "rank": "ref" if reference else "",
        "name": name,
        "parent_ms": lb.parent_ms,
        "course_ms": lb.course_ms,
        "agreement": lb.agreement,
        "attribution": "reference" if reference else lb.attribution,
        "share": None if reference else lb.repository_share,
        "backward": "-" if reference else lb.backward,
        "how": how,
        "ranked": lb.ranked and not reference,
        "why": "" if reference else lb.unranked_because,
        "ran": ", ".join(lb.repository_kernels_ran) or "-",
    }


def markdown_table(header: list[str], rows: list[list[str]]) -> str:
    esc = lambda c: str(c).replace("|", "\\|").replace("\n", " ")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(esc(c) for c in row) + " |" for row in rows])


def _lb_rows(board: list[dict]) -> list[list[str]]:
    ms = lambda v: f"{v:.3f}" if isinstance(v, int | float) else "-"
    share = lambda v: f"{v:.0%}" if isinstance(v, int | float) else "-"
    return [
        [
            b["rank"],
            b["name"],
            ms(b["parent_ms"]),
            ms(b["course_ms"]),
            b["agreement"],
            b["attribution"],
            b["backward"],
            share(b["share"]),
            b["how"],
            b["ran"],
            b["why"],
        ]
        for b in board
    ]


LB_HEADER = [
    "rank",
    "repository",
    "ms (parent's clock)",
    "ms (course's do_bench, the graded process's word)",
    "the two",
    "attribution",
    "backward",
    "GPU time in its kernels",
    "how",
    "repository kernels that ran",
    "no rank because",
]
LB_NOTE = (
    "Ranked on the parent's clock: the grader times verified iterations on inputs the graded code learns "
    "only when the clock starts. Attribution `observed (ncu)`: what ran, and its GPU time, recorded by "
    "Nsight Compute outside the graded process; `self-reported`: the graded process's own record (no "
    "observer on this machine), ranked below every observed row. References are timed the same way. "
    "The course's design ranks: the forward the repository's own Triton, the backward its own Triton or "
    'a PyTorch function under `torch.compile` (the handout: "by calling torch.compile on a regular PyTorch '
    "function (not Triton)\"; a Triton backward is one of its ideas for improvement); a library's attention "
    "(torch's SDPA backends, `flex_attention`, flash-attn) in either phase does not."
)


def chart(board: list[dict], path: Path) -> bytes | None:
    """A dot plot on a linear axis: each row's parent-clock time, references as vertical lines (a
    log-scale bar starts nowhere)."""
    timed = [b for b in board if isinstance(b["parent_ms"], int | float) and b["rank"] != "ref"]
    refs = [b for b in board if b["rank"] == "ref" and isinstance(b["parent_ms"], int | float)]
    if not timed and not refs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * max(1, len(timed)) + 1.6))
    names = [b["name"] for b in timed][::-1]
    for y, b in enumerate(timed[::-1]):
        color = "tab:blue" if b["ranked"] else "tab:red"
        ax.plot(b["parent_ms"], y, "o", color=color)
        if isinstance(b["course_ms"], int | float):
            ax.plot(b["course_ms"], y, "x", color="0.4")
    for i, r in enumerate(refs):
        ax.axvline(
            r["parent_ms"], color=f"C{i + 2}", linestyle="--", label=f"{r['name']} {r['parent_ms']:.2f} ms"
        )
    ax.set_yticks(range(len(names)), names)
    ax.set_xlim(left=0)
    ax.set_xlabel("ms per forward+backward; o: parent's clock (blue ranked, red no rank), x: course do_bench")
    if refs:
        ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    path.write_bytes(buffer.getvalue())
    return buffer.getvalue()


def write(out: Path, names: list[str]) -> tuple[dict[str, Path], str]:
    """The report's files, and what the CLI prints last: the hook table as Markdown, its legend, the
    cases not run as written, and the course's own tests beside the grader (``--course-tests``)."""
    repos = collect(out, names)
    header, rows = hook_table(repos)
    board = leaderboard(repos, anchors(out))
    missing = not_run(repos)
    course = course_table(repos)
    md = [
        "# Class report",
        "",
        "Cells: the hook group's verdict (course tier, then the tiers that fail).",
        "",
        markdown_table(header, rows),
        "",
        legend(rows),
    ]
    if missing:
        md += ["", f"## {NOT_RUN_TITLE}", "", NOT_RUN_NOTE, "", *missing]
    if course:
        md += ["", f"## {COURSE_TITLE}", "", COURSE_NOTE, "", markdown_table(*course)]
    if board:
        md += [
            "",
            "## Leaderboard (2025 case)",
            "",
            LB_NOTE,
            "",
            markdown_table(LB_HEADER, _lb_rows(board)),
        ]
    (out / "class.md").write_text("\n".join(md) + "\n")
    with (out / "class.csv").open("w", newline="") as f:
        csv.writer(f).writerows(csv_rows(repos))
    png = chart(board, out / "leaderboard.png")
    (out / "class.html").write_text(_html(header, rows, board, png, missing, course))
    paths = {"md": out / "class.md", "csv": out / "class.csv", "html": out / "class.html"}
    shown = [markdown_table(header, rows), "", legend(rows)]
    if missing:
        shown += ["", f"{NOT_RUN_TITLE}. {NOT_RUN_NOTE}", *missing]
    if course:
        shown += ["", f"{COURSE_TITLE}. {COURSE_NOTE}", markdown_table(*course)]
    return paths, "\n".join(shown)


def _html(
    header: list[str],
    rows: list[list[str]],
    board: list[dict],
    png: bytes | None,
    missing: list[str],
    course: tuple[list[str], list[list[str]]] | None,
) -> str:
    def table(h: list[str], body: list[list[str]]) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in h)
        cells = lambda row: "".join(f"<td class='{_css(c)}'>{html.escape(str(c))}</td>" for c in row)
        return f"<table><tr>{head}</tr>" + "".join(f"<tr>{cells(r)}</tr>" for r in body) + "</table>"

    image = (
        f"<img alt='leaderboard chart' src='data:image/png;base64,{base64.b64encode(png).decode()}'>"
        if png
        else ""
    )
    style = "body{font-family:sans-serif}table{border-collapse:collapse}td,th{border:1px solid #ccc;padding:4px;font-size:13px}.fail{background:#fdd}.ok{background:#dfd}"
    board_html = (
        f"<h2>Leaderboard (2025 case)</h2><p>{html.escape(LB_NOTE)}</p>{table(LB_HEADER, _lb_rows(board))}{image}"
        if board
        else ""
    )
    items = "".join(f"<li>{html.escape(line.removeprefix('- '))}</li>" for line in missing)
    missing_html = (
        f"<h2>{NOT_RUN_TITLE}</h2><p>{html.escape(NOT_RUN_NOTE.replace('`', ''))}</p><ul>{items}</ul>"
        if missing
        else ""
    )
    course_html = (
        f"<h2>{html.escape(COURSE_TITLE)}</h2><p>{html.escape(COURSE_NOTE.replace('`', ''))}</p>{table(*course)}"
        if course
        else ""
    )
    marks = html.escape(legend(rows).replace("`", ""))
    return f"<!doctype html><html><head><meta charset='utf-8'><title>Class report</title><style>{style}</style></head><body><h1>Class report</h1>{table(header, rows)}<p>{marks}</p>{missing_html}{course_html}{board_html}</body></html>"


def _css(cell: str) -> str:
    cell = str(cell)
    return "fail" if cell.startswith(("FAIL", "cannot", "DISAGREE")) else "ok" if cell == "ok" else ""
