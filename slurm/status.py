"""Each run of a sweep: pending, running, finished, failed or not submitted, with its last logged step and loss.

    python -m slurm.status table4_mu [seeds=3] [cluster.runs_root=DIR]

Read from the run directories (``submit/jobs.jsonl``, ``checkpoints/``, ``metrics.jsonl``) and, where SLURM's
``squeue`` and ``sacct`` are on PATH, from the scheduler.
"""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from slurm.cluster import load_cluster
from slurm.sweep import parse, shown
from slurm.sweeps import ROOT, SweepError, expand, is_finished

_ACTIVE = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "RUNNING": "running",
           "COMPLETING": "running", "SUSPENDED": "running"}


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


def scheduler_state(job_id: str) -> str | None:
    """SLURM's state of ``job_id`` (squeue for live jobs, then sacct), or None without SLURM's tools."""
    if shutil.which("squeue"):
        out = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True).stdout
        if out.strip():
            return out.split()[0]
    if shutil.which("sacct"):
        out = subprocess.run(["sacct", "-n", "-X", "-j", job_id, "-o", "State"], capture_output=True,
                             text=True).stdout
        if out.strip():
            return out.split()[0].rstrip("+")
    return None


def run_state(run_dir: Path) -> dict:
    """``{"state", "job", "slurm", "step", "loss"}`` of one run directory."""
    jobs = run_dir / "submit" / "jobs.jsonl"
    job_id = json.loads(jobs.read_text().splitlines()[-1])["job_id"] if jobs.is_file() else None
    slurm = scheduler_state(job_id) if job_id else None
    rec = last_record(run_dir / "metrics.jsonl")
    if is_finished(run_dir):
        state = "finished"
    elif job_id is None:
        state = "not submitted"
    elif slurm in _ACTIVE:
        state = _ACTIVE[slurm]
    elif slurm is None:
        state = "submitted"  # no scheduler to ask (e.g. read from another machine)
    else:
        state = "failed"
    return {"state": state, "job": job_id, "slurm": slurm, "step": rec and rec.get("step"),
            "loss": rec and rec.get("loss")}


def main(argv: list[str] | None = None) -> int:
    try:
        args, tool, cluster_overrides, _ = parse(argv)
        cluster = load_cluster(cluster_overrides)
        jobs = expand(args.name, seeds=int(tool["seeds"]), runs_root=ROOT / cluster.runs_root, overrides=[],
                      of=tool["of"])
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{'run':<48} {'state':<14} {'job':>10} {'slurm':<11} {'step':>8} {'loss':>8}")
    for job in jobs:
        s = run_state(job.run_dir)
        loss = f"{s['loss']:.4f}" if isinstance(s["loss"], float) else "-"
        print(f"{shown(job.run_dir):<48} {s['state']:<14} {s['job'] or '-':>10} {s['slurm'] or '-':<11} "
              f"{s['step'] if s['step'] is not None else '-':>8} {loss:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
