"""The MQAR recall table from ``python -m eval.mqar`` results JSONs, in the table model of Tables 1-5.

Rows are mixers (registry names with their options, e.g. ``kdn_diag/mu=1``), columns ``setting x width``; a cell is
the test accuracy (%) at the learning rate with the best mean validation accuracy over seeds, as mean ± sample std
over the seeds (n). Several files (seeds or grids run separately) are merged job by job and the learning rate is
chosen again over all their seeds (``eval.mqar.run.summarize``); files that give one setting different budgets or
learning-rate sweeps are refused with :class:`SettingsMismatch`, as are two files holding the same job.

``eval.mqar`` imports torch and the mixers; it is imported inside the functions that need it so that
``import eval.tables`` stays light for Tables 1-5.
"""
from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from eval.tables.model import Cell, Group, Row, SettingsMismatch, Table, diff_row, mark_bold
from eval.tables.specs import Column, TableSpec

MQAR_ID = "mqar_recall"  # not "mqar": its files would overwrite eval.mqar's mqar.json and mqar.md
RESULTS_NAME = "mqar.json"
DEFAULT_REFERENCE = "kda"
JOB_KEYS = ("setting", "mixer", "width", "lr", "seed", "valid_acc", "test_acc", "diverged", "state",
            "state_recurrent", "params")
MATCHED = "Two-layer models, recurrent state matched per width"
UNMATCHED = "Attention (KV cache of 2 T width per layer: grows with T, not matched)"


@dataclass
class MQARFile:
    """One results JSON: its path, header fields and job records (``jobs[i]``: one trained model)."""

    path: Path
    data: dict[str, Any]

    @property
    def jobs(self) -> list[dict[str, Any]]:
        """The file's per-setting records; where the file's arm (its ``init`` and ``precision``) is not the
        default, each ``mixer`` carries it (``kdn_diag_init-authors_fp32``), so that the arms of one experiment are
        rows of their own and never merge into one cell."""
        from eval.mqar.train import DEFAULT_INIT, DEFAULT_PRECISION, arm_suffix, job_precision

        cfg = self.data["config"]
        init, precision = cfg.get("init", DEFAULT_INIT), cfg.get("precision", DEFAULT_PRECISION)
        return [{**j, "mixer": j["mixer"] + arm_suffix(init, job_precision(j["mixer"].split("/")[0], precision))}
                for j in self.data["jobs"]]

    @property
    def config(self) -> Any:
        """The file's ``eval.mqar.MQARConfig`` (keys this version does not know are left out)."""
        from eval.mqar import MQARConfig

        known = {f.name for f in dataclasses.fields(MQARConfig)}
        return MQARConfig(**{k: v for k, v in self.data["config"].items() if k in known})

    def budget(self) -> dict[str, Any]:
        """What this file's models trained on: ``eval.mqar.train.ExampleBudget``'s fields (the training mixture
        included) plus ``lrs``."""
        budget = dataclasses.asdict(self.config.budget())
        return json.loads(json.dumps({**budget, "lrs": sorted(self.config.lrs)}))  # tuples as lists, as in a file


def find_mqar(root: str | Path) -> list[Path]:
    """Every ``mqar.json`` under ``root`` (any depth), sorted."""
    return sorted(Path(root).rglob(RESULTS_NAME))


def read_mqar(paths: list[str | Path]) -> list[MQARFile]:
    """The results files named by ``paths`` (a folder stands for every ``mqar.json`` under it), each once.

    Raises: ``ValueError`` (one line, with the fix) for a missing or unreadable file, invalid JSON, a file that is
    not an MQAR results JSON, or one without its job records."""
    from eval.mqar import load_results

    files: list[Path] = []
    for p in map(Path, paths):
        found = find_mqar(p) if p.is_dir() else [p]
        if not found:
            raise ValueError(f"no {RESULTS_NAME} under {p}; pass the results file of python -m eval.mqar")
        files += [f for f in found if f.resolve() not in {g.resolve() for g in files}]
    out = []
    for path in files:
        data = load_results(path)
        jobs = data.get("jobs")
        if not isinstance(jobs, list) or not isinstance(data.get("config"), dict):
            raise ValueError(f"{path} has no 'jobs' records or 'config'; rewrite it with the python -m eval.mqar "
                             "command that made it (its stored jobs are reused)")
        for job in jobs:
            absent = [k for k in JOB_KEYS if k not in job]
            if absent:
                raise ValueError(f"{path}: job record {job.get('setting')}/{job.get('mixer')} lacks "
                                 f"{', '.join(absent)}; rewrite it with the python -m eval.mqar command that made it")
        out.append(MQARFile(path, data))
    return out


def check_budgets(files: list[MQARFile]) -> None:
    """Raise :class:`SettingsMismatch` when two files hold results of one setting with different budgets or
    learning-rate sweeps: their rows share columns (and would share cells), so they must have trained alike."""
    first: dict[str, tuple[Path, dict[str, Any]]] = {}
    for f in files:
        budget = f.budget()
        for setting in sorted({j["setting"] for j in f.jobs}):
            if setting not in first:
                first[setting] = (f.path, budget)
                continue
            path, ref = first[setting]
            keys = sorted(k for k in ref.keys() | budget.keys() if ref.get(k) != budget.get(k))
            if keys:
                vals = ", ".join(f"{k} ({ref.get(k)} vs {budget.get(k)})" for k in keys)
                raise SettingsMismatch(f"{MQAR_ID}: setting {setting} differs between {path} and {f.path} in {vals}; "
                                       "tabulate them separately (--mqar FILE) or rerun one with the other's keys")


def merged_jobs(files: list[MQARFile]) -> list[dict[str, Any]]:
    """The job records of all ``files``; a ``ValueError`` when two files hold the same job."""
    seen: dict[tuple, Path] = {}
    jobs = []
    for f in files:
        for j in f.jobs:
            key = (j["setting"], j["mixer"], j["width"], j["lr"], j["seed"])
            if key in seen:
                raise ValueError(f"{seen[key]} and {f.path} both hold the job {j['setting']} {j['mixer']} "
                                 f"d{j['width']} lr {j['lr']:g} seed {j['seed']}; pass only one of them (--mqar)")
            seen[key] = f.path
            jobs.append(j)
    return jobs


def _ordered(lists: list[list[Any]], extra: set[Any]) -> list[Any]:
    """The items of ``lists`` in first-seen order, then those of ``extra`` that none of them names, sorted."""
    out: list[Any] = []
    for items in lists:
        out += [x for x in items if x not in out]
    return out + sorted(extra - set(out), key=str)


def _state_note(rows: list[dict[str, Any]]) -> str:
    by_width: dict[int, list[int]] = defaultdict(list)
    for r in rows:
        if r["state_recurrent"]:
            by_width[r["width"]].append(r["state"])
    parts = [f"d{w} {min(s):,}" + (f"–{max(s):,}" if max(s) != min(s) else "") for w, s in sorted(by_width.items())]
    return "recurrent state per width, elements summed over both layers: " + "; ".join(parts) if parts else ""


def build_mqar_table(files: list[MQARFile], *, reference: str = DEFAULT_REFERENCE, diffs: bool = True) -> Table:
    """The MQAR recall table of ``files``.

    Args: ``files``: from :func:`read_mqar`; ``reference``: the mixer the paired differences are taken against;
    ``diffs``: add a ``Δ vs <reference>`` row under each matched-state mixer.
    Returns: a :class:`Table` (id ``mqar_recall``) for the renderers of :mod:`eval.tables.render`; its ``missing`` lists
    the empty cells and the jobs that failed. Raises: :class:`SettingsMismatch` for one setting trained with
    different budgets; ``ValueError`` for a job held by two files."""
    from eval.mqar import summarize
    from eval.mqar.report import settings_of

    if not files:
        raise ValueError("no MQAR results file given; pass the mqar.json of python -m eval.mqar")
    check_budgets(files)
    jobs = merged_jobs(files)
    settings = _ordered([settings_of(f.data["config"]) for f in files], {j["setting"] for j in jobs})
    mixers = _ordered([f.data["config"].get("mixers", []) for f in files], {j["mixer"] for j in jobs})
    rows = summarize(jobs, dataclasses.replace(files[0].config, settings=settings, mixers=mixers))
    by_cell = {(r["setting"], r["mixer"], r["width"]): r for r in rows}
    widths = sorted({r["width"] for r in rows})
    columns = tuple(Column(f"{s}/d{w}", f"{s} d{w}", MQAR_ID) for s in settings for w in widths
                    if any((s, m, w) in by_cell for m in mixers))
    recurrent = {r["mixer"]: r["state_recurrent"] for r in rows}
    lrs = sorted({lr for f in files for lr in f.data["config"].get("lrs", [])})
    note = ["Test accuracy (%) on Zoology's multi-query associative recall at the learning rate (of "
            f"{', '.join(f'{lr:g}' for lr in lrs)}) with the best mean validation accuracy over seeds",
            _state_note(rows)]
    if diffs and reference not in recurrent:
        note.append(f"no Δ rows: the reference {reference} has no result")
    spec = TableSpec(MQAR_ID, "MQAR recall at matched state (test accuracy %)", columns, (),
                     "; ".join(p for p in note if p))
    missing: list[str] = []
    groups = []
    for label, members in ((MATCHED, [m for m in mixers if recurrent.get(m, True)]),
                           (UNMATCHED, [m for m in mixers if not recurrent.get(m, True)])):
        ours = [_row(m, columns, by_cell, missing) for m in members]
        if not ours:
            continue
        mark_bold(ours, columns)
        ref = next((r for r in ours if r.key == reference), None)
        group_rows: list[Row] = []
        for row in ours:
            group_rows.append(row)
            d = diff_row(row, ref, reference, columns) if diffs and ref is not None and row is not ref else None
            if d is not None:
                group_rows.append(d)
        groups.append(Group(label, group_rows))
    for f in files:
        failed = f.data.get("failed_jobs") or []
        if failed:
            missing.append(f"{MQAR_ID} / {f.path}: {len(failed)} failed job(s), e.g. {failed[0].get('job')}: "
                           f"{failed[0].get('error')}; rerun its command ({f.data.get('command')}) to retry them")
    return Table(spec, groups, missing, [str(f.path) for f in files])


def _row(mixer: str, columns: tuple[Column, ...], by_cell: dict[tuple, dict[str, Any]], missing: list[str]) -> Row:
    cells: dict[str, Cell | None] = {}
    absent: list[Column] = []
    for col in columns:
        setting, width = col.key.split("/d")
        r = by_cell.get((setting, mixer, int(width)))
        cells[col.key] = Cell([100 * a for a in r["test_acc"]], list(r["seeds"])) if r else None
        if r is None:
            absent.append(col)
    if absent:  # one job scores every setting of its grid, so the hint names the mixer and widths, not settings
        widths = ",".join(sorted({c.key.split("/d")[1] for c in absent}, key=int))
        missing.append(f"{MQAR_ID} / {mixer} / {', '.join(c.header for c in absent)}: no job of {mixer} there in "
                       f"the MQAR results; run python -m eval.mqar mixers={mixer} widths={widths} with the grid's "
                       "other keys (settings, test_settings, lrs, seeds and budget)")
    return Row(mixer, "ours", cells, mixer)
