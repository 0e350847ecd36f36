"""``python -m eval.tables RUNS_DIR [--paper] [--out DIR] [--tables table1,table4] [--no-diff]
[--throughput bench/results/mixer_throughput.json]``.

Writes ``<id>.md/.tex/.csv/.json`` per table, ``runs.md`` (what was found), ``missing.txt``,
``loss_curves.png`` and, with ``--throughput``, ``fig4_throughput.png/.pdf`` into ``--out``.
"""
from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

from eval.tables.figures import loss_curves, throughput_figure
from eval.tables.model import build_table
from eval.tables.render import write_atomic, write_table
from eval.tables.runs import Run, find_runs
from eval.tables.specs import TABLES


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
    ap.add_argument("--tables", default=",".join(TABLES), help=f"comma-separated subset of {','.join(TABLES)}")
    ap.add_argument("--no-diff", action="store_true", help="leave out the paired differences against the reference")
    ap.add_argument("--throughput", help="bench.mixer_throughput JSON to plot as Fig. 4")
    args = ap.parse_args(argv)
    if args.runs_dir is None and args.throughput is None:
        ap.error("give RUNS_DIR (tables, loss curves) and/or --throughput FILE (Fig. 4)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.throughput:
        for p in throughput_figure(args.throughput, out):
            print(f"wrote {p}")
    if args.runs_dir is None:
        return 0
    ids = [t.strip() for t in args.tables.split(",") if t.strip()]
    unknown = [t for t in ids if t not in TABLES]
    if unknown:
        ap.error(f"unknown table(s) {unknown}; choose from {','.join(TABLES)}")
    runs = find_runs(args.runs_dir)
    if not runs:
        warnings.warn(f"no run (config.yaml or eval/<suite>.json) under {args.runs_dir}", stacklevel=1)
    write_atomic(out / "runs.md", inventory(runs))
    missing: list[str] = []
    for tid in ids:
        table = build_table(TABLES[tid], runs, paper=args.paper, diffs=not args.no_diff)
        for p in write_table(table, out):
            print(f"wrote {p}")
        if table.missing:
            warnings.warn(f"{tid}: {len(table.missing)} missing cell(s):\n  " + "\n  ".join(table.missing),
                          stacklevel=1)
        missing += table.missing
    write_atomic(out / "missing.txt", "".join(m + "\n" for m in missing))
    curves = loss_curves(runs, out / "loss_curves.png")
    if curves is not None:
        print(f"wrote {curves}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
