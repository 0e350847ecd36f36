"""Submit a named sweep to SLURM, one batch job per run.

    python -m slurm.sweep table4_mu --dry-run              # the jobs, their run directories and batch scripts
    python -m slurm.sweep table4_mu                        # submit; prints the job ids
    python -m slurm.sweep table1_750m seeds=3 cluster.partition=gpu cluster.nodes=4
    python -m slurm.sweep table5_noise trainer.max_steps=2000   # any train.py override, added to every run
    python -m slurm.sweep eval of=table4_mu                # the evaluation suites over its finished runs
    python -m slurm.status table4_mu                       # each run's state

Arguments: ``seeds=N`` (training seeds per experiment, default 1), ``force=true`` (re-freeze a run whose config
changed since its first submission; add ``resume=force`` for train.py to adopt the change in a run that has
checkpoints), ``of=SWEEP`` (the eval sweep's training sweep), ``cluster.KEY=VALUE`` (conf/slurm/cluster.yaml); every
other ``key=value`` is a Hydra override of train.py (or of evaluate.py for the eval sweep). Finished runs are
skipped, and so are runs with a queued or running job (every submitted job id is recorded in the run directory's
``submit/jobs.jsonl`` and asked of ``squeue``/``sacct``), so running the same command twice submits nothing twice;
two commands at once take turns (a lock in ``cluster.runs_root``), so the second sees what the first submitted. A
recorded job whose state SLURM cannot tell (``squeue`` missing, failing or not answering, and no ``sacct`` record)
may be live: the sweep stops in one line naming it, unless ``resubmit_unknown=true``.
"""
from __future__ import annotations

import argparse
import contextlib
import fcntl
import sys
from collections.abc import Iterator
from pathlib import Path

from slurm.cluster import ClusterConfig, load_cluster
from slurm.submit import Plan, plan, submit
from slurm.sweeps import ROOT, Job, SweepError, available, expand


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, dict, list[str], list[str]]:
    """``(args, tool settings, cluster overrides, Hydra overrides)``."""
    ap = argparse.ArgumentParser(prog="python -m slurm.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help=f"a sweep in conf/sweep/: {', '.join(available())}")
    ap.add_argument("overrides", nargs="*", help="seeds=N, force=true, of=SWEEP, resubmit_unknown=true, "
                                                 "cluster.KEY=VALUE, train overrides")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs and their batch scripts; submit nothing")
    args = ap.parse_intermixed_args(argv)
    tool = {"seeds": "1", "force": "false", "of": None, "resubmit_unknown": "false"}
    cluster, hydra = [], []
    for item in args.overrides:
        key, eq, value = item.partition("=")
        if not eq:
            raise SweepError(f"{item!r}: arguments are key=value (e.g. seeds=3 or mixer.mu=1)")
        if key in tool:
            tool[key] = value
        elif key.startswith("cluster."):
            cluster.append(f"{key.removeprefix('cluster.')}={value}")
        else:
            hydra.append(item)
    if not tool["seeds"].isdigit():
        raise SweepError(f"seeds={tool['seeds']}: give a whole number of training seeds")
    for key in ("force", "resubmit_unknown"):
        if tool[key] not in ("true", "false"):
            raise SweepError(f"{key}={tool[key]}: true or false")
    return args, tool, cluster, hydra


def shown(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def plans(name: str, tool: dict, cluster: ClusterConfig, hydra: list[str]) -> list[Plan]:
    """Every job of the sweep, checked (all before any submission: one bad run stops the whole sweep)."""
    jobs: list[Job] = expand(name, seeds=int(tool["seeds"]), runs_root=ROOT / cluster.runs_root, overrides=hydra,
                             of=tool["of"])
    if not jobs:
        raise SweepError(f"sweep {name} has no job to run (for eval: no run of of={tool['of']} has finished yet)")
    return [plan(j, cluster, force=tool["force"] == "true", resubmit_unknown=tool["resubmit_unknown"] == "true")
            for j in jobs]


@contextlib.contextmanager
def submission_lock(runs_root: Path) -> Iterator[None]:
    """Hold ``runs_root/.submit.lock`` (waiting, with a line on stderr, while another sweep command holds it): the
    plans made inside see every job that an earlier holder submitted. Released when the process ends, however."""
    runs_root.mkdir(parents=True, exist_ok=True)
    path = runs_root / ".submit.lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"waiting: another sweep command is submitting into {shown(runs_root)} (lock {shown(path)})",
                  file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        yield


def main(argv: list[str] | None = None) -> int:
    try:
        args, tool, cluster_overrides, hydra = parse(argv)
        cluster = load_cluster(cluster_overrides)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.nullcontext() if args.dry_run else submission_lock(ROOT / cluster.runs_root):
        return _plan_and_submit(args, tool, cluster, hydra)


def _plan_and_submit(args: argparse.Namespace, tool: dict, cluster: ClusterConfig, hydra: list[str]) -> int:
    try:
        todo = plans(args.name, tool, cluster, hydra)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for p in todo:
        state = f"skip ({p.skip})" if p.skip else ("dry-run" if args.dry_run else "submit")
        steps = f"  {p.total_steps} steps" if p.total_steps else ""
        print(f"{state:<15} {p.job.name}  {shown(p.job.run_dir)}{steps}\n"
              f"{'':<15} {' '.join(p.job.command())}")
    if args.dry_run:
        for p in todo:
            print(f"\n===== {p.job.name} =====\n{p.script}")
        return 0
    try:
        for p in todo:
            if not p.skip:
                print(f"submitted {p.job.name}: job {submit(p)}")
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
