"""One table model (values, seeds, bold, missing cells) from the runs; every output format renders it.

A row's cell is the mean over the training seeds of its experiment, with the sample standard deviation and ``n``.
A paired-difference row gives, per column, the mean and spread of ``row - reference`` over the seeds both rows
have. Results of one suite with differing evaluation settings in one table are refused. A row whose results were
not evaluated as the paper's were is marked, and the paper's rows are then listed apart, never beside ours.
"""
from __future__ import annotations

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from eval.tables.paper import PAPER, PAPER_MARKS, paper_protocol_gap
from eval.tables.runs import Experiment, Run, preset_identity
from eval.tables.specs import MEAN, RETRIEVAL_TASKS, RULER_CELLS, Column, GroupSpec, RowSpec, TableSpec

MISSING = "—"
# per suite, the evaluation settings that change a number: results of one suite must agree on them within a table.
# A key absent from every file agrees; RULER's max_length is left out (its prompts are built to each cell's
# length, whatever lm-eval's max_length says).
SETTING_KEYS: dict[str, tuple[str, ...]] = {
    "lm": ("max_length", "limit", "num_fewshot", "tokenizer_sha256"),
    "ruler": ("samples_per_cell", "seed", "haystack.sha256", "tokenizer_sha256", "max_new_tokens"),
    "retrieval": ("truncation", "context_tokens", "limit", "max_new_tokens", "tokenizer_sha256"),
}


class SettingsMismatch(ValueError):
    """Results with differing evaluation (or data) settings were asked to share one table."""


@dataclass
class Cell:
    """Per-seed values of one cell (``seeds[i]`` gave ``values[i]``); ``diff`` marks a paired difference."""

    values: list[float]
    seeds: list[int] = field(default_factory=list)
    bold: bool = False
    diff: bool = False

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.values)

    @property
    def std(self) -> float | None:
        """Sample standard deviation (``n - 1``); ``None`` for one value."""
        return statistics.stdev(self.values) if self.n > 1 else None

    def text(self, digits: int = 2) -> str:
        """``18.64``, ``18.64 ± 0.12 (n=3)``; a difference carries its sign and always its ``n``."""
        sign = "+" if self.diff else ""
        s = f"{self.mean:{sign}.{digits}f}"
        if self.std is not None:
            s += f" ± {self.std:.{digits}f}"
        if self.n > 1 or self.diff:
            s += f" (n={self.n})"
        return s


@dataclass
class Row:
    label: str
    kind: str  # "ours", "paper" or "diff"
    cells: dict[str, Cell | None]
    key: str = ""
    note: str = ""  # e.g. "not the paper's haystack": printed after the label in every format


@dataclass
class Group:
    label: str
    rows: list[Row]


@dataclass
class Table:
    spec: TableSpec
    groups: list[Group]
    missing: list[str]
    runs: list[str]
    notes: list[str] = field(default_factory=list)  # why marked rows are not comparable with the paper's

    @property
    def columns(self) -> tuple[Column, ...]:
        return self.spec.columns


def value_of(run: Run, column: Column) -> tuple[float | None, str | None]:
    """``(value, None)`` or ``(None, why it is missing)`` for one run and column."""
    res = run.results.get(column.suite)
    if res is None:
        return None, f"{run.path} has no eval/{column.suite}.json (run evaluate.py model={run.path} " \
                     f"suites=[{column.suite}])"
    metric = column.metric
    if column.suite == "lm":
        v = (res.get("summary") or {}).get(metric)
    else:
        cells = RULER_CELLS if column.suite == "ruler" else RETRIEVAL_TASKS
        scores = {c: (res.get("results") or {}).get(c, {}).get("score") for c in cells}
        if metric == MEAN:  # our own equal-weight mean, only over the complete set
            absent = [c for c, s in scores.items() if s is None]
            if absent:
                return None, f"{run.path}: eval/{column.suite}.json lacks {', '.join(absent)} for the mean"
            v = statistics.fmean(float(s) for s in scores.values())
        else:
            v = scores.get(metric)
    if v is None or not math.isfinite(float(v)):
        return None, f"{run.path}: eval/{column.suite}.json has no {metric} (rerun that suite)"
    return float(v), None


def _setting(res: dict[str, Any], key: str) -> Any:
    cur: Any = res.get("settings") or {}
    for part in key.split("."):
        cur = cur.get(part) if isinstance(cur, dict) else None
    return cur


def check_settings(spec: TableSpec, runs: list[Run]) -> None:
    """Raise :class:`SettingsMismatch` naming the setting, its values and their runs when results of one suite
    (or the runs' data seeds) differ within the table."""
    suites = {c.suite for c in spec.columns}
    for suite in sorted(suites):
        for key in SETTING_KEYS.get(suite, ()):
            seen: dict[Any, list[str]] = defaultdict(list)
            for run in runs:
                if suite in run.results:
                    seen[repr(_setting(run.results[suite], key))].append(str(run.path))
            if len(seen) > 1:
                vals = "; ".join(f"{v} ({', '.join(p)})" for v, p in seen.items())
                raise SettingsMismatch(f"{spec.id} mixes {suite} results with different settings.{key}: {vals}; "
                                       "re-evaluate them with one setting or tabulate them from separate folders")
    data_seeds: dict[Any, list[str]] = defaultdict(list)
    for run in runs:
        if run.data_seed is not None:
            data_seeds[run.data_seed].append(str(run.path))
    if len(data_seeds) > 1:
        vals = "; ".join(f"{v} ({', '.join(p)})" for v, p in data_seeds.items())
        raise SettingsMismatch(f"{spec.id} mixes runs trained on different data.seed: {vals}; every model of a "
                               "comparison must read the same token stream")


def _index(runs: list[Run]) -> dict[Experiment, list[Run]]:
    by_exp: dict[Experiment, dict[int, Run]] = defaultdict(dict)
    for run in runs:
        other = by_exp[run.experiment].get(run.seed)
        if other is not None:
            raise ValueError(f"{other.path} and {run.path} are both {run.experiment.describe()} with seed "
                             f"{run.seed}; keep one of them or tabulate them from separate folders")
        by_exp[run.experiment][run.seed] = run
    return {e: [s[k] for k in sorted(s)] for e, s in by_exp.items()}


def _preset_for(row: RowSpec, column: Column, identities: dict[str, Experiment]) -> str:
    if column.pattern is None:
        return row.presets[0]
    for p in row.presets:
        if identities[p].pattern == column.pattern:
            return p
    raise ValueError(f"row {row.label!r} has no preset with backbone pattern {column.pattern!r}")


def _our_row(spec: TableSpec, row: RowSpec, by_exp: dict[Experiment, list[Run]],
             identities: dict[str, Experiment], missing: list[str], used: set[str], gaps: list[str]) -> Row:
    """``row`` from its runs; marked (``note``) when a value came from results off the paper's protocol, whose
    reasons are added to ``gaps``."""
    cells: dict[str, Cell | None] = {}
    note = ""
    why_missing: dict[str, list[str]] = defaultdict(list)  # reason -> the columns it leaves empty
    for col in spec.columns:
        preset = _preset_for(row, col, identities)
        runs = by_exp.get(identities[preset], [])
        if not runs:
            why_missing[f"no run of {identities[preset].describe()}; train and evaluate "
                        f"experiment={preset}"].append(col.header)
        values, seeds = [], []
        for run in runs:
            used.add(str(run.path))
            v, why = value_of(run, col)
            if v is None:
                why_missing[str(why)].append(col.header)
            else:
                values.append(v)
                seeds.append(run.seed)
                gap = paper_protocol_gap(col.suite, run.results[col.suite].get("settings") or {})
                if gap is not None:
                    note = PAPER_MARKS[col.suite]
                    gaps.append(f"{row.label}: {gap}")
        cells[col.key] = Cell(values, seeds) if values else None
    missing += [f"{spec.id} / {row.label} / {', '.join(cols)}: {why}" for why, cols in why_missing.items()]
    return Row(row.label, "ours", cells, row.key, note)


def diff_row(row: Row, ref: Row, label: str, columns: tuple[Column, ...]) -> Row | None:
    """``row - ref`` per column over the seeds both cells have, labelled ``Δ vs <label>``; ``None`` when no column
    has a common seed."""
    cells: dict[str, Cell | None] = {}
    for col in columns:
        a, b = row.cells.get(col.key), ref.cells.get(col.key)
        if a is None or b is None:
            cells[col.key] = None
            continue
        ref_by_seed = dict(zip(b.seeds, b.values))
        pairs = [(s, v - ref_by_seed[s]) for s, v in zip(a.seeds, a.values) if s in ref_by_seed]
        cells[col.key] = Cell([d for _, d in pairs], [s for s, _ in pairs], diff=True) if pairs else None
    if all(c is None for c in cells.values()):
        return None
    return Row(f"Δ vs {label}", "diff", cells, row.key)


def mark_bold(rows: list[Row], columns: tuple[Column, ...]) -> None:
    """Bold the best mean (to two decimals) of the ``ours`` rows per column, where at least two rows have one."""
    for col in columns:
        cands = [r.cells[col.key] for r in rows if r.kind == "ours" and r.cells.get(col.key) is not None]
        if len(cands) < 2:
            continue
        pick = min if col.lower_is_better else max
        best = pick(round(c.mean, 2) for c in cands)  # type: ignore[union-attr]
        for c in cands:
            c.bold = round(c.mean, 2) == best  # type: ignore[union-attr]


def _paper_row(spec: TableSpec, row: RowSpec) -> Row | None:
    values = PAPER.get(spec.id, {}).get(row.key)
    if not values:
        return None
    cells = {c.key: (Cell([values[c.key]]) if c.key in values else None) for c in spec.columns}
    return Row(f"{row.label} (paper)", "paper", cells, row.key)


def build_table(spec: TableSpec, runs: list[Run], *, paper: bool = False, diffs: bool = True) -> Table:
    """The table model of ``spec`` from ``runs``.

    Args: ``runs``: every run found (those of experiments the table does not show are ignored); ``paper``: add the
    published numbers as reference rows; ``diffs``: add each row's paired difference against its group's reference.
    Returns: the :class:`Table` (its ``missing`` lists every empty cell with the run or preset that would fill it).
    A row whose results were not evaluated as the paper's were (:func:`eval.tables.paper.paper_protocol_gap`) is
    marked; then the paper's rows are not placed beside ours but listed apart, after our groups.
    Raises: :class:`SettingsMismatch` when the results it uses disagree on an evaluation setting or data seed;
    ``ValueError`` for two runs of one experiment with the same seed."""
    identities = {p: preset_identity(p) for g in spec.groups for r in g.rows for p in r.presets}
    wanted = set(identities.values())
    mine = [r for r in runs if r.experiment in wanted]
    check_settings(spec, mine)
    by_exp = _index(mine)
    missing: list[str] = []
    used: set[str] = set()
    gaps: list[str] = []
    ours = [[_our_row(spec, r, by_exp, identities, missing, used, gaps) for r in g.rows] for g in spec.groups]
    apart = paper and any(r.note for rows in ours for r in rows)
    groups = [_group(spec, g, rows, paper=paper and not apart, diffs=diffs) for g, rows in zip(spec.groups, ours)]
    if apart:
        for g in spec.groups:
            published = [p for p in (_paper_row(spec, r) for r in g.rows) if p is not None]
            if published:
                groups.append(Group(f"The paper's published numbers, not comparable with ours: {g.label}",
                                    published))
    return Table(spec, groups, missing, sorted(used), list(dict.fromkeys(gaps)))


def _group(spec: TableSpec, g: GroupSpec, ours: list[Row], *, paper: bool, diffs: bool) -> Group:
    mark_bold(ours, spec.columns)
    ref = next((r for r in ours if r.key == g.reference), None)
    ref_label = next((r.label for r in g.rows if r.key == g.reference), "")
    rows: list[Row] = []
    for spec_row, row in zip(g.rows, ours):
        rows.append(row)
        if diffs and ref is not None and row is not ref:
            d = diff_row(row, ref, ref_label, spec.columns)
            if d is not None:
                rows.append(d)
        if paper:
            p = _paper_row(spec, spec_row)
            if p is not None:
                rows.append(p)
    return Group(g.label, rows)
