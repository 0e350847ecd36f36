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
from collections.abc import Callable, Iterator
from dataclasses import dataclass, fields
from pathlib import Path

from common.options import parse_options
from slurm.cluster import ClusterConfig, load_cluster
from slurm.submit import Plan, plan, submit
from slurm.sweeps import ROOT, Job, SweepError, available, expand, load_sweep


@dataclass
class SweepOptions:
    """The sweep command's own ``key=value`` options; every other key is the training (or evaluation) script's."""

    seeds: int = 1  # training seeds per experiment
    force: bool = False  # re-freeze a run whose config changed since its first submission
    of: str | None = None  # the eval sweep's training sweep
    resubmit_unknown: bool = False  # submit although a recorded job's state cannot be told


def _target_keys(kind: str) -> tuple[set[str], Callable[[list[str]], None]]:
    """The first key parts the sweep's script (train.py or evaluate.py) accepts, and its override-key check."""
    if kind == "eval":
        from eval.config import check_override_keys, top_level_keys

        return top_level_keys(), check_override_keys
    from trainer.config import CONF_DIR, TrainConfig, check_override_keys

    return {*(f.name for f in fields(TrainConfig)), *(p.name for p in CONF_DIR.iterdir() if p.is_dir()),
            "hydra"}, check_override_keys


def parse(argv: list[str] | None) -> tuple[argparse.Namespace, SweepOptions, list[str], list[str]]:
    """``(args, tool options, cluster overrides, Hydra overrides)``: the tool's options and ``cluster.KEY=VALUE``
    read by ``common.options.parse_options``, the rest checked against the sweep's script's config keys, so that a
    typo anywhere is one line with a did-you-mean."""
    ap = argparse.ArgumentParser(prog="python -m slurm.sweep", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", help=f"a sweep in conf/sweep/: {', '.join(available())}")
    ap.add_argument("overrides", nargs="*", help="seeds=N, force=true, of=SWEEP, resubmit_unknown=true, "
                                                 "cluster.KEY=VALUE, train overrides")
    ap.add_argument("--dry-run", action="store_true", help="print the jobs and their batch scripts; submit nothing")
    args = ap.parse_intermixed_args(argv)
    keys, check_keys = _target_keys(load_sweep(args.name)["kind"])

    def passthrough(key: str) -> bool:
        return key.startswith("cluster.") or key.split(".")[0] in keys or any(c in key for c in "@/")

    values, rest = parse_options(SweepOptions, args.overrides, passthrough=passthrough,
                                 other_names=[*keys, "cluster"], example="seeds=3 or mixer.mu=1")
    cluster = [item.removeprefix("cluster.") for item in rest if item.startswith("cluster.")]
    hydra = [item for item in rest if not item.startswith("cluster.")]
    check_keys(hydra)
    return args, SweepOptions(**values), cluster, hydra


def shown(path: Path) -> str:
    """``path`` relative to the checkout when it lies inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def plans(name: str, tool: SweepOptions, cluster: ClusterConfig, hydra: list[str]) -> list[Plan]:
    """Every job of the sweep, checked (all before any submission: one bad run stops the whole sweep)."""
    jobs: list[Job] = expand(name, seeds=tool.seeds, runs_root=ROOT / cluster.runs_root, overrides=hydra, of=tool.of)
    if not jobs:
        raise SweepError(f"sweep {name} has no job to run (for eval: no run of of={tool.of} has finished yet)")
    return [plan(j, cluster, force=tool.force, resubmit_unknown=tool.resubmit_unknown) for j in jobs]


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
    except ValueError as e:  # SweepError, and the options' and the script's config key errors
        print(f"error: {e}", file=sys.stderr)
        return 2
    with contextlib.nullcontext() if args.dry_run else submission_lock(ROOT / cluster.runs_root):
        return _plan_and_submit(args, tool, cluster, hydra)


def _plan_and_submit(args: argparse.Namespace, tool: SweepOptions, cluster: ClusterConfig, hydra: list[str]) -> int:
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
