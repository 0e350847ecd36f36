"""Each run of a sweep: pending, running, finished, failed, ended (no record of how), unknown (SLURM could not be
asked) or not submitted, with its last logged step and loss, and every job submitted for it with SLURM's state of
each.

    python -m slurm.status table4_mu [seeds=3] [cluster.runs_root=DIR]

Read from the run directories (``submit/jobs.jsonl``, ``checkpoints/``, ``metrics.jsonl``) and, where SLURM's
``squeue`` and ``sacct`` are on PATH, from the scheduler. A run with more than one queued or running job is named
on stderr with the ``scancel`` that leaves one.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from slurm.cluster import load_cluster
from slurm.jobs import ACTIVE, UNKNOWN, active_jobs, job_states
from slurm.sweep import parse, shown
from slurm.sweeps import ROOT, expand, is_finished


def last_record(metrics: Path) -> dict | None:
    """The last complete training record of ``metrics.jsonl`` (a torn last line is skipped)."""
    if not metrics.is_file():
        return None
    last = None
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "loss" in rec:
            last = rec
    return last


def run_state(run_dir: Path, kind: str = "train") -> dict:
    """``{"state", "job", "slurm", "jobs", "step", "loss"}`` of one run directory: ``jobs`` lists ``(job id, SLURM
    state or None)`` of every job of ``kind`` submitted for it, oldest first; ``job`` and ``slurm`` are the live one
    (the oldest when several are live), else the newest."""
    jobs = job_states(run_dir, kind)
    live = active_jobs(jobs)
    job_id, slurm = live[0] if live else (jobs[-1] if jobs else (None, None))
    rec = last_record(run_dir / "metrics.jsonl")
    if kind == "train" and is_finished(run_dir):
        state = "finished"
    elif job_id is None:
        state = "not submitted"
    elif live:
        state = "running" if any(ACTIVE[s] == "running" for _, s in live) else "pending"
    elif slurm == UNKNOWN:
        state = "unknown"  # SLURM could not be asked (e.g. read from another machine): it may be live
    elif slurm is None:
        state = "ended"  # not queued, and sacct holds no record of how it ended
    elif slurm == "COMPLETED" and kind == "eval":
        state = "finished"
    else:
        state = "failed"
    return {"state": state, "job": job_id, "slurm": slurm, "jobs": jobs, "step": rec and rec.get("step"),
            "loss": rec and rec.get("loss")}


def main(argv: list[str] | None = None) -> int:
    try:
        args, tool, cluster_overrides, _ = parse(argv)
        cluster = load_cluster(cluster_overrides)
        jobs = expand(args.name, seeds=tool.seeds, runs_root=ROOT / cluster.runs_root, overrides=[], of=tool.of)
    except ValueError as e:  # SweepError, and the options' key errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'run':<48} {'state':<14} {'job':>10} {'slurm':<11} {'step':>8} {'loss':>8}  every job (id:state)")
    duplicates = []
    for job in jobs:
        s = run_state(job.run_dir, job.kind)
        loss = f"{s['loss']:.4f}" if isinstance(s["loss"], float) else "-"
        every = ",".join(f"{j}:{state or '?'}" for j, state in s["jobs"]) or "-"
        print(f"{shown(job.run_dir):<48} {s['state']:<14} {s['job'] or '-':>10} {s['slurm'] or '-':<11} "
              f"{s['step'] if s['step'] is not None else '-':>8} {loss:>8}  {every}")
        live = active_jobs(s["jobs"])
        if len(live) > 1:
            duplicates.append(f"{shown(job.run_dir)} has {len(live)} live jobs ({', '.join(j for j, _ in live)}); "
                              f"keep the oldest: scancel {' '.join(j for j, _ in live[1:])}")
    for line in duplicates:
        print(f"warning: {line}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
