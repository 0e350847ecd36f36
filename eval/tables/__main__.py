"""``python -m eval.tables RUNS_DIR [--paper] [--out DIR] [--tables table1,table4,mqar_recall] [--no-diff]
[--throughput bench/results/mixer_throughput.json] [--mqar FILE [FILE ...]] [--mqar-reference kda]``.

Writes ``<id>.md/.tex/.csv/.json`` per table, ``your_runs.md/.tex/.csv/.json`` (every evaluated run, paper preset
or not), ``runs.md`` (what was found), ``missing.txt`` (empty cells, runs that matched no paper row, files skipped),
``loss_curves.png`` and, with ``--throughput``, ``fig4_throughput.png/.pdf`` into ``--out``. The MQAR recall table
(``mqar_recall.*``) is built from the ``mqar.json`` files under RUNS_DIR, or from those ``--mqar`` names instead.
A table that is refused (mixed evaluation settings, duplicate runs, a bad MQAR file) is not written, and its files
from an earlier invocation are removed from ``--out``, so that none of them reads as current.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eval.tables.figures import loss_curves, throughput_figure
from eval.tables.model import Table, build_table
from eval.tables.mqar import DEFAULT_REFERENCE, MQAR_ID, build_mqar_table, find_mqar, read_mqar
from eval.tables.render import remove_table, write_atomic, write_table
from eval.tables.runs import Run, find_runs
from eval.tables.specs import TABLES
from eval.tables.yours import YOURS_ID, build_runs_table, write_runs_table


def inventory(runs: list[Run]) -> str:
    """A Markdown list of the runs found: identity, seed, suites, last training step and losses."""
    lines = ["| run | experiment | seed | suites | step | tokens | loss | val_loss |",
             "|---|---|---:|---|---:|---:|---:|---:|"]
    for r in runs:
        last = r.train[-1] if r.train else {}
        val = r.val[-1]["val_loss"] if r.val else None
        cells = [str(r.path), r.experiment.describe(), str(r.seed), ",".join(sorted(r.results)) or "—",
                 str(last.get("step", "—")), str(last.get("tokens", "—")),
                 f"{last['loss']:.4f}" if "loss" in last else "—", f"{val:.4f}" if val is not None else "—"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m eval.tables", description=__doc__.split("\n\n")[0])
    ap.add_argument("runs_dir", nargs="?", help="folder holding the run directories (config.yaml, eval/*.json)")
    ap.add_argument("--paper", action="store_true", help="add the paper's published numbers as reference rows")
    ap.add_argument("--out", default="tables", help="output folder (default: tables/)")
    choices = ",".join([*TABLES, MQAR_ID])
    ap.add_argument("--tables", default=choices, help=f"comma-separated subset of {choices}")
    ap.add_argument("--no-diff", action="store_true", help="leave out the paired differences against the reference")
    ap.add_argument("--throughput", help="bench.mixer_throughput JSON to plot as Fig. 4")
    ap.add_argument("--mqar", nargs="+", metavar="FILE", help="python -m eval.mqar results JSONs (or folders of "
                    "them) for the MQAR table, merged; default: every mqar.json under RUNS_DIR")
    ap.add_argument("--mqar-reference", default=DEFAULT_REFERENCE, metavar="MIXER",
                    help=f"mixer the MQAR table's paired differences are taken against (default: {DEFAULT_REFERENCE})")
    args = ap.parse_args(argv)
    if args.runs_dir is None and args.throughput is None and not args.mqar:
        ap.error("give RUNS_DIR (tables, loss curves), --mqar FILE (MQAR table) and/or --throughput FILE (Fig. 4)")
    ids = [t.strip() for t in args.tables.split(",") if t.strip()]
    unknown = [t for t in ids if t not in TABLES and t != MQAR_ID]
    if unknown:
        ap.error(f"unknown table(s) {unknown}; choose from {choices}")
    if args.mqar and MQAR_ID not in ids:
        ap.error(f"--mqar given but --tables leaves out {MQAR_ID}; add it to --tables")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.throughput:
        for p in throughput_figure(args.throughput, out):
            print(f"wrote {p}")
    missing: list[str] = []
    refused = 0
    if args.runs_dir is not None:
        try:
            missing, refused = tables_of_runs(args.runs_dir, [t for t in ids if t in TABLES], out,
                                              paper=args.paper, diffs=not args.no_diff)
        except ValueError as err:  # RUNS_DIR is no directory
            raise SystemExit(f"eval.tables: {err}") from None
    mqar_paths = args.mqar or (find_mqar(args.runs_dir) if args.runs_dir is not None else [])
    if MQAR_ID in ids and mqar_paths:
        try:
            table = build_mqar_table(read_mqar(mqar_paths), reference=args.mqar_reference, diffs=not args.no_diff)
        except ValueError as err:  # bad file, mixed budgets, duplicate job: one line, the other tables are written
            reason = str(err).removeprefix(f"{MQAR_ID}: ")
            missing.append(f"{MQAR_ID}: not written: {reason}")
            write_atomic(out / "missing.txt", "".join(m + "\n" for m in missing))
            raise SystemExit(f"eval.tables: {MQAR_ID}: {reason}{removed_note(out, MQAR_ID)}") from None
        missing += emit(table, MQAR_ID, out)
    elif MQAR_ID in ids and args.runs_dir is not None and remove_table(out, MQAR_ID):  # else read as this one's
        missing.append(f"{MQAR_ID}: not written: no mqar.json under {args.runs_dir} (give --mqar FILE); the "
                       f"earlier {MQAR_ID}.* in {out} are removed")
        say(missing[-1])
    if args.runs_dir is not None or (MQAR_ID in ids and mqar_paths):
        write_atomic(out / "missing.txt", "".join(m + "\n" for m in missing))
    if missing:
        say(f"{len(missing)} line(s) of missing cells, unmatched runs and skipped files: {out / 'missing.txt'}")
    return 1 if refused else 0


def say(line: str) -> None:
    """One plain line on stderr (no source location, unlike a warning)."""
    print(line, file=sys.stderr)


def removed_note(out: Path, tid: str) -> str:
    """Remove the files of the refused table ``tid`` that an earlier invocation left in ``out``; the words that say
    so ("" when there were none)."""
    return f" (the earlier {tid}.* in {out} are removed)" if remove_table(out, tid) else ""


def emit(table: Table, tid: str, out: Path) -> list[str]:
    """Write ``table`` (every rendering) into ``out``, say in one line how many cells are missing and return them."""
    write_table(table, out)
    print(f"wrote {out / tid}.{{md,tex,csv,json}}")
    if table.missing:
        say(f"{tid}: {len(table.missing)} missing cell(s) or row(s), listed in missing.txt")
    return table.missing


def tables_of_runs(runs_dir: str, ids: list[str], out: Path, *, paper: bool, diffs: bool) -> tuple[list[str], int]:
    """Write ``runs.md``, the tables ``ids``, the table of your runs and the loss curves of the runs under
    ``runs_dir`` into ``out``.

    Returns: the lines for ``missing.txt`` (files skipped, missing cells, runs that matched no paper row, tables
    refused) and the number of tables refused (mixed evaluation settings, duplicate runs). Every refusal and
    skipped file is said in one line; the other tables are still written, and a refused table's files from an
    earlier invocation are removed."""
    skipped: list[str] = []
    runs = find_runs(runs_dir, skipped)
    for line in skipped:
        say(line)
    if not runs:
        say(f"no run (config.yaml or eval/<suite>.json) under {runs_dir}")
    write_atomic(out / "runs.md", inventory(runs))
    missing = list(skipped)
    refused = 0
    for tid in ids:
        try:
            table = build_table(TABLES[tid], runs, paper=paper, diffs=diffs)
        except ValueError as err:  # SettingsMismatch or two runs of one experiment and seed
            say(f"eval.tables: {tid} not written: {err}{removed_note(out, tid)}")
            missing.append(f"{tid}: not written: {err}")
            refused += 1
            continue
        missing += emit(table, tid, out)
    yours = build_runs_table(runs, runs_dir)
    write_runs_table(yours, out)
    print(f"wrote {out / YOURS_ID}.{{md,tex,csv,json}} ({len(yours.rows)} evaluated run(s))")
    if yours.unmatched:
        say(f"{YOURS_ID}: {len(yours.unmatched)} run(s) matched no paper row (why: missing.txt)")
    missing += yours.unmatched
    curves = loss_curves(runs, out / "loss_curves.png")
    if curves is not None:
        print(f"wrote {curves}")
    elif (out / "loss_curves.png").exists():  # an earlier invocation's curves, of other runs
        (out / "loss_curves.png").unlink()
        say(f"loss curves not written: no run has training records (the earlier {out / 'loss_curves.png'} is "
            "removed)")
    return missing, refused


if __name__ == "__main__":
    sys.exit(main())
