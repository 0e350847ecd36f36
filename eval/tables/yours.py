"""The table of your runs: every evaluated run under RUNS_DIR, paper preset or not, one row each.

A row holds the run's identity (mixer with its options, size, backbone pattern, seed, tokens trained), the paper
tables its experiment fills, a score per suite it has (over whatever cells or tasks it ran) and the evaluation
settings that decide whether its numbers compare with the paper's. Runs whose experiment is no paper preset's are
also named, with the closest preset and how they differ, for ``missing.txt``.
"""
from __future__ import annotations

import csv
import io
import json
import math
import statistics
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from eval.tables.paper import paper_protocol_gap
from eval.tables.render import latex_text, write_atomic
from eval.tables.runs import Experiment, Run, preset_identity
from eval.tables.specs import TABLES, TableSpec

YOURS_ID = "your_runs"
TITLE = "Your runs: every evaluated run, paper preset or not"
COLUMNS = ("Run", "Mixer", "Size", "Pattern", "Seed", "Tokens", "Paper tables", "LM avg", "Wiki. ppl", "RULER",
           "Retrieval", "Held-out ppl", "beta_eff", "Evaluation settings")
NONE = "—"
CAPTION = ("LM avg: the six-accuracy mean (%); RULER and Retrieval: the mean over the cells or tasks the run has "
           "(%), which is the paper's mean only with all 14 cells or 6 tasks; Held-out ppl: per split; beta_eff: "
           "the probe's mean; Paper tables: the tables whose rows the run's experiment fills ('none': see "
           "missing.txt)")


@dataclass
class RunsTable:
    """``rows``: one list of cell strings per evaluated run, in :data:`COLUMNS` order; ``unmatched``: one line per
    run whose experiment no paper row trains, saying why."""

    root: str
    rows: list[list[str]]
    unmatched: list[str]


def paper_presets(specs: dict[str, TableSpec] = TABLES) -> dict[str, tuple[Experiment, list[str]]]:
    """Per preset of the paper tables: its experiment and the ids of the tables with a row it fills."""
    out: dict[str, tuple[Experiment, list[str]]] = {}
    for spec in specs.values():
        for preset in (p for g in spec.groups for r in g.rows for p in r.presets):
            ids = out.setdefault(preset, (preset_identity(preset), []))[1]
            if spec.id not in ids:
                ids.append(spec.id)
    return out


def _mixer(exp: Experiment) -> str:
    return exp.describe().split("/", 2)[2]


def closest_preset(exp: Experiment, presets: dict[str, tuple[Experiment, list[str]]]) -> str:
    """``closest preset P differs in size (small vs 750m)``: the preset whose experiment differs from ``exp`` in
    the fewest fields (ties: the first by name)."""
    def diffs(other: Experiment) -> list[str]:
        return [f"{f.name} ({getattr(exp, f.name) or NONE} vs {getattr(other, f.name) or NONE})"
                for f in fields(Experiment) if getattr(exp, f.name) != getattr(other, f.name)]

    name = min(sorted(presets), key=lambda p: len(diffs(presets[p][0])))
    return f"closest preset {name} differs in {', '.join(diffs(presets[name][0]))}"


def _num(x: Any, digits: int = 2) -> str:
    return f"{float(x):.{digits}f}" if isinstance(x, (int, float)) and math.isfinite(x) else NONE


def _count(n: Any) -> str:
    """``40960 -> 40.96K``, ``5.0e10 -> 50.00B``."""
    if not isinstance(n, (int, float)):
        return NONE
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}{unit}"
    return str(int(n))


def _mean_of(res: dict[str, Any], unit: str) -> str:
    scores = [float(v["score"]) for v in (res.get("results") or {}).values()
              if isinstance(v, dict) and isinstance(v.get("score"), (int, float)) and math.isfinite(v["score"])]
    return f"{statistics.fmean(scores):.2f} ({len(scores)} {unit})" if scores else NONE


def scores(run: Run) -> list[str]:
    """The run's score cells: LM avg, Wiki. ppl, RULER, Retrieval, Held-out ppl, beta_eff."""
    r = run.results
    lm = (r.get("lm") or {}).get("summary") or {}
    ppl = (r.get("ppl") or {}).get("summary") or {}
    beta = (r.get("beta_eff") or {}).get("summary") or {}
    return [_num(lm.get("avg")), _num(lm.get("wiki_ppl")),
            _mean_of(r["ruler"], "cells") if "ruler" in r else NONE,
            _mean_of(r["retrieval"], "tasks") if "retrieval" in r else NONE,
            ", ".join(f"{k.removesuffix('_ppl')} {_num(v)}" for k, v in sorted(ppl.items())) or NONE,
            _num(beta.get("mean"), 3)]


def settings_text(run: Run) -> str:
    """The evaluation settings that decide comparability, per suite the run has: ``ruler: kjv haystack sha256
    cd34... (not the paper's), 20/cell, seed 0; retrieval: truncation jrt, 2048 tokens (the paper's)``. Two RULER
    results share prompts only where their haystack digests agree, so the digest is part of the text."""
    parts = []
    for suite in sorted(run.results):
        s = run.results[suite].get("settings") or {}
        limit = f", limit {s['limit']}" if s.get("limit") else ""
        paper = "" if suite not in ("ruler", "retrieval") else \
            " (not the paper's)" if paper_protocol_gap(suite, s) else " (the paper's)"
        if suite == "ruler":
            hay = s.get("haystack") or {}
            digest = f" sha256 {hay['sha256'][:12]}" if hay.get("sha256") else " of unrecorded sha256"
            parts.append(f"ruler: {hay.get('name') or hay.get('source') or 'unrecorded'} haystack{digest}{paper}, "
                         f"{s.get('samples_per_cell', '?')}/cell, seed {s.get('seed', '?')}")
        elif suite == "retrieval":
            parts.append(f"retrieval: truncation {s.get('truncation') or 'unrecorded'}, "
                         f"{s.get('context_tokens', '?')} tokens{paper}{limit}")
        elif suite == "lm":
            parts.append(f"lm: max_length {s.get('max_length', '?')}{limit or ', full sets'}")
        elif suite in ("ppl", "beta_eff"):
            parts.append(f"{suite}: seq_len {s.get('seq_len', '?')}")
    return "; ".join(parts)


def _tokens(run: Run) -> str:
    if run.train and "tokens" in run.train[-1]:
        return _count(run.train[-1]["tokens"])
    return _count(next((res.get("model", {}).get("tokens_trained") for res in run.results.values()
                        if (res.get("model") or {}).get("tokens_trained") is not None), None))


def _size(run: Run) -> str:
    params = next((res["model"]["parameters"] for res in run.results.values()
                   if isinstance((res.get("model") or {}).get("parameters"), int)), None)
    return f"{run.experiment.size} ({_count(params)} params)" if params else run.experiment.size


def _name(run: Run, root: Path) -> str:
    try:
        return str(run.path.relative_to(root))
    except ValueError:
        return str(run.path)


def build_runs_table(runs: list[Run], root: str | Path,
                     presets: dict[str, tuple[Experiment, list[str]]] | None = None) -> RunsTable:
    """The table of ``runs`` found under ``root``.

    Args: ``runs``: every run found; ``presets``: :func:`paper_presets` (computed when not given).
    Returns: a row per run with results (those without are left to ``runs.md``), and an ``unmatched`` line per
    run, evaluated or not, whose experiment is no paper preset's."""
    presets = paper_presets() if presets is None else presets
    tables_of: dict[Experiment, list[str]] = {}
    for exp, ids in presets.values():
        tables_of[exp] = sorted({*tables_of.get(exp, []), *ids})
    root = Path(root)
    rows, unmatched = [], []
    for run in runs:
        ids = tables_of.get(run.experiment)
        if ids is None:
            todo = "" if run.results else f"; not evaluated yet (python evaluate.py model={run.path})"
            unmatched.append(f"{YOURS_ID} / {run.path}: matched no paper row: {run.experiment.describe()} is no "
                             f"paper preset's experiment ({closest_preset(run.experiment, presets)}){todo}; "
                             f"its scores are in {YOURS_ID}.md")
        if run.results:
            exp = run.experiment
            rows.append([_name(run, root), _mixer(exp), _size(run), exp.pattern, str(run.seed), _tokens(run),
                         ", ".join(ids) if ids else "none", *scores(run), settings_text(run)])
    return RunsTable(str(root), rows, unmatched)


def runs_markdown(t: RunsTable) -> str:
    """A Markdown table, one row per evaluated run, with the caption under it."""
    lines = [f"**{TITLE} (under {t.root})**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join([":---"] * 4 + ["---:"] * 2 + [":---"] + ["---:"] * 6 + [":---"]) + "|"]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in t.rows]
    if not t.rows:
        lines.append(f"| *no evaluated run under {t.root}* |" + " |" * (len(COLUMNS) - 1))
    return "\n".join([*lines, "", CAPTION + "."]) + "\n"


def runs_latex(t: RunsTable) -> str:
    """A booktabs ``tabular`` scaled to the text width."""
    n = len(COLUMNS)
    body = [" & ".join(latex_text(c) for c in row) + r" \\" for row in t.rows] or \
        [rf"\multicolumn{{{n}}}{{l}}{{\textit{{no evaluated run under {latex_text(t.root)}}}}} \\"]
    lines = [r"% needs \usepackage{booktabs} and \usepackage{graphicx}", r"\begin{table}[t]", r"\centering",
             r"\small", rf"\caption{{{latex_text(TITLE)}. {latex_text(CAPTION)}.}}", rf"\label{{tab:{YOURS_ID}}}",
             r"\resizebox{\linewidth}{!}{%", r"\begin{tabular}{llllrrlrrrrrrl}", r"\toprule",
             " & ".join(latex_text(c) for c in COLUMNS) + r" \\", r"\midrule", *body, r"\bottomrule",
             r"\end{tabular}", "}", r"\end{table}"]
    return "\n".join(lines) + "\n"


def runs_csv(t: RunsTable) -> str:
    """The header, then one line per evaluated run."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerows([COLUMNS, *t.rows])
    return buf.getvalue()


def write_runs_table(t: RunsTable, out: Path) -> list[Path]:
    """``your_runs.md``, ``.tex``, ``.csv`` and ``.json`` in ``out``; returns the paths."""
    data = {"id": YOURS_ID, "title": TITLE, "root": t.root, "columns": list(COLUMNS),
            "rows": [dict(zip(COLUMNS, row)) for row in t.rows], "unmatched": t.unmatched}
    texts = {"md": runs_markdown(t), "tex": runs_latex(t), "csv": runs_csv(t),
             "json": json.dumps(data, indent=1, ensure_ascii=False) + "\n"}
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext, text in texts.items():
        write_atomic(out / f"{YOURS_ID}.{ext}", text)
        paths.append(out / f"{YOURS_ID}.{ext}")
    return paths
