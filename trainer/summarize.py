"""Summaries of finished runs from their ``metrics.jsonl`` (for docs/results/README.md).

    python -m trainer.summarize runs/a runs/b            # one row per run: loss, tokens/s/GPU, MFU, memory
    python -m trainer.summarize --compare runs/a runs/b  # loss-curve agreement of two runs (e.g. 1 vs 2 GPUs)

Speed columns are medians over the logged intervals after the first (which includes start-up and
compilation). A directory without training records (a refused or not yet started run, a folder of another
kind) is skipped with a line naming it on stderr; the command fails only when no run is left.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Any

from common import read_jsonl, write_json_atomic
from trainer.metrics import log_torn


def read_metrics(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Training records and validation records of a run, in step order."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path} does not exist; pass a run directory written by train.py")
    rows = read_jsonl(path, on_torn=log_torn)
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def summarize(run_dir: Path) -> dict[str, Any]:
    """One row: steps, first/last loss, last validation loss, median tokens/s/device, MFU, peak memory."""
    train, val = read_metrics(run_dir)
    if not train:
        raise ValueError(f"{run_dir} has no training record yet")
    steady = train[1:] or train

    def median(key: str) -> float | None:
        values = [r[key] for r in steady if r.get(key) is not None]
        return statistics.median(values) if values else None

    return {"run": str(run_dir), "steps": train[-1]["step"], "first_loss": train[0]["loss"],
            "last_loss": train[-1]["loss"], "val_loss": val[-1]["val_loss"] if val else None,
            "tokens_per_s_per_device": median("tokens_per_s_per_device"), "mfu": median("mfu"),
            "peak_mem_gib": max((r["peak_mem_gib"] for r in train if "peak_mem_gib" in r), default=None)}


def compare(a: Path, b: Path, window: int = 10) -> dict[str, Any]:
    """Agreement of two loss curves on their common steps, after a trailing mean over ``window`` logs:
    the largest and the final relative gap; and the largest relative gap of their validation losses at the
    evaluations they share (``None`` without one)."""
    (train_a, val_a), (train_b, val_b) = read_metrics(a), read_metrics(b)
    la = {r["step"]: r["loss"] for r in train_a}
    lb = {r["step"]: r["loss"] for r in train_b}
    steps = sorted(la.keys() & lb.keys())
    if len(steps) < window:
        raise ValueError(f"{a} and {b} share {len(steps)} logged steps; need at least {window}")

    def smooth(d: dict[int, float]) -> list[float]:
        xs = [d[s] for s in steps]
        return [sum(xs[max(0, i - window + 1): i + 1]) / len(xs[max(0, i - window + 1): i + 1]) for i in range(len(xs))]

    sa, sb = smooth(la), smooth(lb)
    gaps = [abs(x - y) / y for x, y in zip(sa, sb)][window:]
    va = {r["step"]: r["val_loss"] for r in val_a}
    vb = {r["step"]: r["val_loss"] for r in val_b}
    val_gaps = [abs(va[s] - vb[s]) / vb[s] for s in sorted(va.keys() & vb.keys())]
    return {"a": str(a), "b": str(b), "common_steps": len(steps), "max_rel_gap": max(gaps),
            "final_rel_gap": gaps[-1], "final_loss_a": sa[-1], "final_loss_b": sb[-1],
            "val_common_steps": len(val_gaps), "val_max_rel_gap": max(val_gaps, default=None)}


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.4g}" if isinstance(x, float) else str(x)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", type=Path)
    p.add_argument("--compare", action="store_true", help="compare the loss curves of exactly two runs")
    p.add_argument("--tol", type=float, default=0.02, help="largest relative gap accepted by --compare")
    p.add_argument("--json", type=Path, help="also write the result as JSON here")
    args = p.parse_args(argv)
    if args.compare:
        if len(args.runs) != 2:
            p.error("--compare takes exactly two run directories")
        try:
            result: Any = compare(*args.runs)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(" | ".join(f"{k} {_fmt(v)}" for k, v in result.items()))
        ok = result["max_rel_gap"] <= args.tol
        print(f"{'MATCH' if ok else 'MISMATCH'}: largest smoothed relative gap {result['max_rel_gap']:.4f} "
              f"(tolerance {args.tol})")
    else:
        result = []
        for run in args.runs:
            try:
                result.append(summarize(run))
            except ValueError as e:  # no metrics.jsonl, no training record yet, or a damaged line
                print(f"skipped {run}: {e}", file=sys.stderr)
        if not result:
            print(f"no run to summarise among {len(args.runs)} director{'y' if len(args.runs) == 1 else 'ies'}",
                  file=sys.stderr)
            return 1
        keys = list(result[0])
        print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
        for row in result:
            print("| " + " | ".join(_fmt(row[k]) for k in keys) + " |")
        ok = True
    if args.json:
        write_json_atomic(args.json, result)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
