"""Tables -> Markdown and LaTeX text."""

from __future__ import annotations

import pandas as pd

from cs336_systems.report.tables import GroupTable


def to_markdown(frame: pd.DataFrame) -> str:
    if frame.empty:
        return "_(no rows)_"
    return frame.to_markdown(index=False, disable_numparse=True)


_LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "$": r"\$", "#": r"\#", "_": r"\_"}
_LATEX_ESCAPES.update({"{": r"\{", "}": r"\}", "~": r"\textasciitilde{}", "^": r"\textasciicircum{}"})


def _latex_escape(text: str) -> str:
    out = "".join(_LATEX_ESCAPES.get(ch, ch) for ch in str(text))
    return out.replace("±", r"$\pm$").replace("—", "--").replace("·", r"$\cdot$")


def to_latex(frame: pd.DataFrame, caption: str) -> str:
    """A booktabs table; cells are escaped here so ``±`` becomes ``$\\pm$`` (pdflatex-safe)."""
    if frame.empty:
        return f"% {caption}: no rows\n"
    escaped = frame.map(_latex_escape)
    escaped.columns = [_latex_escape(c) for c in frame.columns]
    try:
        body = escaped.to_latex(index=False, escape=False)  # needs jinja2 (pandas Styler)
    except ImportError:
        from tabulate import tabulate

        # latex_raw: the cells are escaped above already.
        body = tabulate(escaped.values.tolist(), headers=list(escaped.columns), tablefmt="latex_raw") + "\n"
    return (
        "\\begin{table}[ht]\n\\centering\n\\small\n"
        + body
        + f"\\caption{{{_latex_escape(caption)}}}\n\\end{{table}}\n"
    )


def readable(frame: pd.DataFrame, index_cols: int) -> pd.DataFrame:
    """A table with many value columns and few rows reads better turned on its side: one row per
    quantity, one column per case (named by its index columns)."""
    if frame.empty or len(frame) > 6 or frame.shape[1] - index_cols <= 12:
        return frame
    names = [
        ", ".join(f"{c}={row[c]}" for c in frame.columns[:index_cols]) or f"case {i + 1}"
        for i, (_, row) in enumerate(frame.iterrows())
    ]
    body = frame.iloc[:, index_cols:].T
    body.columns = names if len(set(names)) == len(names) else [f"{i + 1}: {n}" for i, n in enumerate(names)]
    return body.rename_axis("quantity").reset_index()


MAX_LINE = 1000  # characters per writeup line (issue 51: a row of 1,093 made the page unreadable)


def fitting(frame: pd.DataFrame, index_cols: int) -> list[pd.DataFrame]:
    """``frame``, or, when its Markdown rows would run past MAX_LINE (results files of one group merged
    bring their own columns: the 8B step's reached 1,250 characters), parts of it one under the other,
    each with the case columns and the value columns that fit."""
    if frame.empty or frame.shape[1] <= index_cols + 1:
        return [frame]
    # a pipe-table column (tabulate) takes its widest cell, or its header plus 2, and "| " and a space
    widths = [
        max(len(str(frame.columns[i])) + 2, *(len(str(v)) for v in frame.iloc[:, i])) + 3
        for i in range(frame.shape[1])
    ]
    base = 1 + sum(widths[:index_cols])
    parts: list[list[int]] = [[]]
    width = base
    for i in range(index_cols, frame.shape[1]):
        if parts[-1] and width + widths[i] > MAX_LINE:
            parts.append([])
            width = base
        parts[-1].append(i)
        width += widths[i]
    if len(parts) == 1:
        return [frame]
    return [frame.iloc[:, [*range(index_cols), *cols]] for cols in parts]


def _markdown(frame: pd.DataFrame, index_cols: int) -> str:
    return "\n\n".join(to_markdown(part) for part in fitting(frame, index_cols))


def footnote_lines(notes: list[str]) -> list[str]:
    """The texts the tables' ``[n]`` markers point to, one paragraph each."""
    return [f"[{i}] {note}" + "  " for i, note in enumerate(notes, 1)] + ([""] if notes else [])


def withheld_line(table: GroupTable, table_file: str | None = None) -> str:
    """What the writeup prints for a table none of whose timings is a result (``GroupTable.withheld``)."""
    where = f" (`{table_file}` keeps its marked cells)" if table_file else ""
    return (
        f"_No timing in this table is a result{where}: the footnotes below say why. "
        "`--show-unreliable` prints the figures, marked._"
    )


def _withheld_parts(table: GroupTable, table_file: str | None) -> list[str]:
    """The one line, then the columns that time nothing (they stand whatever the load), if any."""
    untimed = table.untimed()
    if untimed.shape[1] <= table.index_columns:
        return [withheld_line(table, table_file), ""]
    shown = readable(untimed, table.index_columns)
    index = 1 if shown is not untimed else table.index_columns
    return [withheld_line(table, table_file), "", _markdown(shown, index), ""]


def render_group_markdown(
    table: GroupTable, fold_withheld: bool = False, table_file: str | None = None
) -> str:
    """A group's Markdown: its pivot (the handout's view) with the long table folded under it, or the
    long table. ``fold_withheld`` (the writeup): a table with no timing that is a result is one line
    and its untimed columns, ``table_file`` naming where its full table is."""
    parts = [f"### {table.group}", "", f"_{table.caption}_", ""]
    if fold_withheld and table.withheld:
        parts += _withheld_parts(table, table_file)
    elif table.pivot is not None:
        parts += [f"**{table.pivot.attrs.get('title', 'view')}**", "", to_markdown(table.pivot), ""]
        parts += [
            "<details><summary>all columns</summary>",
            "",
            _markdown(table.long, table.index_columns),
            "",
            "</details>",
            "",
        ]
    else:
        shown = readable(table.long, table.index_columns)
        parts += [_markdown(shown, 1 if shown is not table.long else table.index_columns), ""]
    parts += footnote_lines(table.footnotes)
    parts += [*table.absent, ""] if table.absent else []
    return "\n".join(parts)


def render_group_latex(table: GroupTable) -> str:
    parts = [f"% {table.group} (generated by cs336_systems.report)"]
    if table.pivot is not None:
        parts.append(to_latex(table.pivot, f"{table.caption}: {table.pivot.attrs.get('title', '')}"))
    long = table.long if table.pivot is not None else readable(table.long, table.index_columns)
    parts.append(to_latex(long, table.caption))
    parts += [f"\\par\\footnotesize [{i}] {_latex_escape(n)}" for i, n in enumerate(table.footnotes, 1)]
    parts += [f"\\par\\footnotesize {_latex_escape(line)}" for line in table.absent]
    return "\n".join(parts)
