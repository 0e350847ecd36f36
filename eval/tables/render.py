"""Markdown, LaTeX (booktabs), CSV and JSON renderings of one :class:`eval.tables.model.Table`.

Every text format reads the same cell strings from :func:`grid`, so the three agree cell for cell; Markdown and
LaTeX add the bold of the best cell per column and a row per group label.
"""
from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

from common import write_atomic
from eval.tables.model import MISSING, Table

EXTENSIONS = ("md", "tex", "csv", "json")  # the renderings of a table, one file each
KIND_NOTE = {"paper": "published numbers", "diff": "the row minus the reference row, paired over their common seeds"}


def grid(table: Table) -> list[tuple[str, str, str, list[tuple[str, bool]]]]:
    """``(group, row label, kind, [(cell text, bold)])`` per row, in order; a marked row's label carries its mark,
    e.g. ``KDA (not the paper's haystack)``."""
    out = []
    for g in table.groups:
        for r in g.rows:
            cells = [(c.text(), c.bold) if c is not None else (MISSING, False)
                     for c in (r.cells.get(col.key) for col in table.columns)]
            out.append((g.label, f"{r.label} ({r.note})" if r.note else r.label, r.kind, cells))
    return out


def markdown(table: Table) -> str:
    """A GitHub-flavoured Markdown table with italic group rows and bold best cells."""
    heads = ["Model", *(c.header for c in table.columns)]
    lines = [f"**{table.spec.title}**", "", "| " + " | ".join(heads) + " |",
             "|" + "|".join([":---"] + ["---:"] * len(table.columns)) + "|"]
    group = None
    for g, label, _, cells in grid(table):
        if g != group:
            lines.append(f"| *{g}* |" + " |" * len(table.columns))
            group = g
        texts = [f"**{t}**" if b else t for t, b in cells]
        lines.append("| " + " | ".join([label, *texts]) + " |")
    lines += ["", _caption(table)]
    return "\n".join(lines) + "\n"


WIDE = 9  # tables with more columns are scaled to the text width
LATEX_ESCAPES = {"\\": r"\textbackslash{}", "&": r"\&", "%": r"\%", "#": r"\#", "_": r"\_", "$": r"\$",
                 "{": r"\{", "}": r"\}"}
LATEX_SYMBOLS = {"±": r"$\pm$", "—": "--", "Δ": r"$\Delta$"}


def latex_text(s: str) -> str:
    """``s`` escaped for LaTeX text mode (± and Δ as math, the missing mark as an en dash)."""
    out = "".join(LATEX_ESCAPES.get(ch, ch) for ch in s)
    for sym, tex in LATEX_SYMBOLS.items():
        out = out.replace(sym, tex)
    return out


def latex(table: Table) -> str:
    """A booktabs ``tabular`` in a ``table`` float; ``\\midrule`` between groups, bold best cells."""
    n = len(table.columns)
    wide = n > WIDE
    lines = [r"% needs \usepackage{booktabs}" + (r" and \usepackage{graphicx}" if wide else ""),
             r"\begin{table}[t]", r"\centering", r"\small",
             rf"\caption{{{latex_text(table.spec.title)}. {latex_text(_caption(table))}}}",
             rf"\label{{tab:{table.spec.id}}}", *([r"\resizebox{\linewidth}{!}{%"] if wide else []),
             r"\begin{tabular}{l" + "r" * n + "}", r"\toprule",
             " & ".join(["Model", *(latex_text(c.header) for c in table.columns)]) + r" \\"]
    group = None
    for g, label, _, cells in grid(table):
        if g != group:
            lines += [r"\midrule", rf"\multicolumn{{{n + 1}}}{{l}}{{\textit{{{latex_text(g)}}}}} \\"]
            group = g
        texts = [rf"\textbf{{{latex_text(t)}}}" if b else latex_text(t) for t, b in cells]
        lines.append(" & ".join([latex_text(label), *texts]) + r" \\")
    lines += [r"\bottomrule", r"\end{tabular}", *(["}"] if wide else []), r"\end{table}"]
    return "\n".join(lines) + "\n"


def csv_text(table: Table) -> str:
    """One line per row: group, model, kind, then the cell strings (bold is not representable)."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(["group", "model", "kind", *(c.header for c in table.columns)])
    for g, label, kind, cells in grid(table):
        w.writerow([g, label, kind, *(t for t, _ in cells)])
    return buf.getvalue()


def as_json(table: Table) -> dict[str, Any]:
    """The numbers behind the table: per cell its seeds, values, mean, std, n and bold."""
    def cell(c: Any) -> dict[str, Any] | None:
        if c is None:
            return None
        return {"mean": c.mean, "std": c.std, "n": c.n, "seeds": c.seeds, "values": c.values, "bold": c.bold}

    return {"id": table.spec.id, "title": table.spec.title, "columns": [c.key for c in table.columns],
            "groups": [{"label": g.label, "rows": [{"label": r.label, "kind": r.kind, "key": r.key, "note": r.note,
                                                    "cells": {k: cell(v) for k, v in r.cells.items()}}
                                                   for r in g.rows]} for g in table.groups],
            "missing": table.missing, "runs": table.runs, "not_comparable_with_paper": table.notes}


def _caption(table: Table) -> str:
    kinds = sorted({r.kind for g in table.groups for r in g.rows} - {"ours"})
    parts = [table.spec.note] if table.spec.note else []
    parts.append("Cells: mean ± sample std over training seeds (n), bold best of our rows per column and group")
    parts += [f"'{k}' rows: {KIND_NOTE[k]}" for k in kinds]
    if table.notes:
        parts.append("Marked rows were not evaluated as the paper's were, so the paper's rows are listed apart: "
                     + "; ".join(table.notes))
    if table.missing:
        parts.append(f"{MISSING}: no result ({len(table.missing)} missing)")
    return "; ".join(p.rstrip(".") for p in parts) + "."


def write_table(table: Table, out: Path) -> list[Path]:
    """``<id>.md``, ``.tex``, ``.csv`` and ``.json`` in ``out``; returns the paths."""
    out.mkdir(parents=True, exist_ok=True)
    texts = dict(zip(EXTENSIONS, (markdown(table), latex(table), csv_text(table),
                                  json.dumps(as_json(table), indent=1) + "\n")))
    paths = []
    for ext, text in texts.items():
        path = out / f"{table.spec.id}.{ext}"
        write_atomic(path, text)
        paths.append(path)
    return paths


def remove_table(out: Path, tid: str) -> list[Path]:
    """Delete ``<tid>.md``, ``.tex``, ``.csv`` and ``.json`` from ``out``: the files of a table that an earlier
    invocation wrote and this one refused, which would otherwise read as current. Returns the paths removed."""
    removed = []
    for ext in EXTENSIONS:
        path = out / f"{tid}.{ext}"
        if path.is_file():
            path.unlink()
            removed.append(path)
    return removed
