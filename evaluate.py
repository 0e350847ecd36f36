"""Evaluate an exported model (``runs/<name>/hf``): lm-eval tasks (Table 1) and held-out perplexity.

    python evaluate.py runs/small_recurrent_kdn_diag/hf --ppl data/cache/embedded-kjv-mistral-v1
    python evaluate.py runs/<name>/hf --tasks table1                 # WikiText, LAMBADA + six accuracies
    python evaluate.py runs/<name>/hf --tasks piqa,arc_easy --limit 200
    python evaluate.py runs/<name>/hf --tasks my_task --include-path eval/tasks   # local lm-eval task YAMLs
    python evaluate.py runs/<name>/hf --overwrite data/cache/<shards>       # beta_eff probe (Fig. 2), + PNG

Results are printed and written (temp file, then rename) to ``--out`` (default: ``<model dir>/../eval.json``).
lm-eval's hub tasks need their datasets in the Hugging Face cache (``HF_DATASETS_OFFLINE=1`` on clusters).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import data  # noqa: F401  (our packages load before the checkout leaves sys.path, see _unshadow)
import models  # noqa: F401
from eval.harness import TABLE1_TASKS, load_model, run_tasks, table1_row
from eval.overwrite import plot, probe_beta_eff, summarize
from eval.perplexity import shard_perplexity

ROOT = Path(__file__).resolve().parent


def _unshadow() -> None:
    """This script shares its name with Hugging Face's ``evaluate`` library, which some lm-eval tasks import.
    Run as a script, take the checkout off ``sys.path`` (our packages are loaded by now) so they find the library."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]


def write_atomic(path: Path, payload: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
        json.dump(payload, f, indent=1)
    os.replace(f.name, path)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path, help="a Hugging Face model directory exported by train.py")
    ap.add_argument("--tasks", default="", help="'table1' or comma-separated lm-eval task names")
    ap.add_argument("--limit", type=int, default=None, help="at most this many examples per task")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--include-path", default=None, help="folder of extra lm-eval task YAMLs")
    ap.add_argument("--ppl", type=Path, default=None, help="a shard directory from data.prepare")
    ap.add_argument("--split", default="val")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--max-batches", type=int, default=None)
    ap.add_argument("--overwrite", type=Path, default=None, help="shard directory for the beta_eff probe")
    ap.add_argument("--probe-seqs", type=int, default=8)
    ap.add_argument("--probe-len", type=int, default=2048)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    if not args.tasks and args.ppl is None and args.overwrite is None:
        ap.error("nothing to evaluate: pass --tasks, --ppl and/or --overwrite")
    model, tokenizer = load_model(args.model, device=args.device)
    report: dict = {"model": str(args.model)}
    if args.ppl is not None:
        report["perplexity"] = shard_perplexity(model, args.ppl, split=args.split, seq_len=args.seq_len,
                                                max_batches=args.max_batches)
        print(f"{args.split} loss {report['perplexity']['loss']:.4f}  ppl {report['perplexity']['ppl']:.2f}  "
              f"({report['perplexity']['tokens']} tokens)")
    if args.tasks:
        tasks = list(TABLE1_TASKS) if args.tasks == "table1" else [t for t in args.tasks.split(",") if t]
        report["tasks"] = run_tasks(model, tokenizer, tasks, batch_size=args.batch_size, limit=args.limit,
                                    include_path=args.include_path)
        report["table1"] = table1_row(report["tasks"])
        for task, metrics in report["tasks"].items():
            print(f"{task:<20}" + "  ".join(f"{m} {v:.4f}" for m, v in sorted(metrics.items())))
    out = args.out or args.model.parent / "eval.json"
    if args.overwrite is not None:
        betas = probe_beta_eff(model, args.overwrite, n_seqs=args.probe_seqs, seq_len=args.probe_len)
        report["overwrite"] = summarize(betas)
        plot(betas, out.with_name(out.stem + "_beta_eff.png"))
        pooled = report["overwrite"]["pooled"]
        print(f"beta_eff: mean {pooled['mean']:.3f}  median {pooled['q50']:.3f}  "
              f"share >= 0.9 {pooled['overwrite_share']:.3f}  ({len(betas)} layers)")
    write_atomic(out, report)
    return report


if __name__ == "__main__":
    _unshadow()
    main()
