"""Check, render, freeze and submit one job.

At the first accepted submission the composed training config, the git commit and the rendered batch script are
frozen into ``<run_dir>/submit/``; a later submission of the same run (a resubmit after a failure, or the same sweep
command again) must compose to the same config, or it is refused with the differing keys unless ``force=true``. A
submission that sbatch did not accept freezes nothing. Every accepted job id is recorded in the run's ledger
(``slurm.jobs``), and a run with a queued or running job is skipped, so the same command twice submits nothing twice.
"""
from __future__ import annotations

import contextlib
import json
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass

from omegaconf import OmegaConf

from slurm.cluster import ClusterConfig
from slurm.jobs import ACTIVE, UNKNOWN, active_jobs, job_states, record_job
from slurm.sweeps import ROOT, Job, SweepError, is_finished

PAPER_VOCAB = 32_000  # the FLOPs estimate of the timeout check assumes the paper's vocabulary
# the batch shell's test of slurm.sweeps.restart_reason: prints the reason and exits 0 when the run may start over
RESTART_CHECK = ("import sys; from slurm.sweeps import restart_reason; why = restart_reason(sys.argv[1]); "
                 "print(why) if why else sys.exit(1)")


@dataclass
class Plan:
    """A checked job, ready to submit."""

    job: Job
    script: str
    config: dict | None  # the composed training config (None for evaluation jobs)
    total_steps: int | None
    skip: str | None  # why the job is not submitted (finished, or its queued or running job), or None


def compose_train(overrides: tuple[str, ...]) -> tuple[dict, object]:
    """``(resolved dict, validated TrainConfig)`` of train.py's config with ``overrides``."""
    from hydra import compose, initialize_config_dir

    from trainer.config import ConfigError, load_config

    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        try:
            cfg = compose("config", overrides=list(overrides))
            return OmegaConf.to_container(cfg, resolve=True), load_config(cfg)
        except ConfigError:
            raise
        except Exception as e:  # Hydra's override errors: the first line names the key
            raise SweepError(str(e).splitlines()[0]) from e


def check_budget(job: Job, cfg: object, cluster: ClusterConfig) -> int:
    """Total optimiser steps for the cluster's world size; ``SweepError`` if the batch does not split over it or
    if a job's time limit is shorter than one checkpoint interval at ``cluster.assumed_mfu``."""
    from models import count_flops_per_token
    from trainer.config import ConfigError, build_model_config, derive_budget

    try:
        budget = derive_budget(cfg, world_size=cluster.world_size)
    except ConfigError as e:
        raise SweepError(f"{job.name}: {e} (world size {cluster.nodes} node(s) x {cluster.gpus_per_node} GPUs)") from e
    flops = count_flops_per_token(build_model_config(cfg, PAPER_VOCAB), cfg.data.seq_len) * budget.tokens_per_step
    step_s = flops / (cluster.world_size * cluster.peak_tflops_per_gpu * 1e12 * cluster.assumed_mfu)
    every = cfg.trainer.ckpt_every if cfg.trainer.ckpt_every > 0 else budget.total_steps
    interval_min = every * step_s / 60
    usable_min = cluster.timeout_min - cluster.signal_delay_s / 60
    if interval_min > usable_min:
        raise SweepError(
            f"{job.name}: a checkpoint every {every} steps takes about {interval_min:.0f} min at "
            f"{cluster.assumed_mfu:.0%} MFU on {cluster.world_size} GPUs, longer than the {cluster.timeout_min}-min "
            "limit: lower trainer.ckpt_every or raise cluster.timeout_min")
    return budget.total_steps


def render(job: Job, cluster: ClusterConfig) -> str:
    """The batch script of ``job``: its resources, then ``slurm/requeue.sh`` running the job's command."""
    train = job.kind == "train"
    nodes, gpus = (cluster.nodes, cluster.gpus_per_node) if train else (1, cluster.eval_gpus)
    minutes = cluster.timeout_min if train else cluster.eval_timeout_min
    lines = ["#!/bin/bash", f"# {job.kind} job {job.name} (sweep {job.sweep}), rendered by python -m slurm.sweep",
             f"#SBATCH --job-name={job.name}", f"#SBATCH --nodes={nodes}", "#SBATCH --ntasks-per-node=1",
             f"#SBATCH --gpus-per-node={gpus}", f"#SBATCH --cpus-per-task={cluster.cpus_per_task}",
             f"#SBATCH --mem={cluster.mem}", f"#SBATCH --time={minutes}",
             f"#SBATCH --signal=USR1@{cluster.signal_delay_s}", "#SBATCH --requeue", "#SBATCH --open-mode=append",
             f"#SBATCH --output={job.run_dir.resolve()}/submit/{'eval' if not train else 'train'}-%j.out"]
    for key in ("partition", "account", "qos", "constraint"):
        if getattr(cluster, key):
            lines.append(f"#SBATCH --{key}={getattr(cluster, key)}")
    if cluster.exclusive and train:
        lines.append("#SBATCH --exclusive")
    lines += ["set -uo pipefail", f"cd {shlex.quote(str(ROOT))}", f"export KDN_MAX_REQUEUES={cluster.max_requeues}"]
    command = shlex.join(job.command())
    if train and not any(o.startswith("resume=") for o in job.overrides):
        # a start after a hard failure before the run's first checkpoint (a node failure that SLURM requeued, or a
        # resubmission) starts over rather than stopping to ask for resume=restart: no trained state exists to lose
        check = f"{shlex.quote(sys.executable)} -c {shlex.quote(RESTART_CHECK)} {shlex.quote(str(job.run_dir))}"
        lines += ["restart=", f"if why=$({check}); then",
                  '  echo "batch shell: $why; starting it over (resume=restart)"', "  restart=resume=restart", "fi"]
        command += " $restart"
    lines += [f"exec bash slurm/requeue.sh {command}", ""]
    return "\n".join(lines)


def _differences(old: dict, new: dict, prefix: str = "") -> list[str]:
    keys = sorted(set(old) | set(new))
    out = []
    for k in keys:
        a, b = old.get(k), new.get(k)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _differences(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {a!r} -> {b!r}")
    return out


def plan(job: Job, cluster: ClusterConfig, force: bool = False, resubmit_unknown: bool = False) -> Plan:
    """Check ``job`` against the cluster and against what its run directory froze at first submission;
    ``resubmit_unknown``: see :func:`live_job`."""
    if job.kind == "eval":
        return Plan(job, render(job, cluster), None, None, live_job(job, resubmit_unknown))
    config, cfg = compose_train(job.overrides)
    total = check_budget(job, cfg, cluster)
    frozen = job.run_dir / "submit" / "config.json"
    if frozen.is_file() and not force:
        diff = _differences(json.loads(frozen.read_text()), config)
        if diff:
            raise SweepError(f"{job.name}: {job.run_dir} was submitted with another config ({'; '.join(diff[:6])}"
                             f"{'; ...' if len(diff) > 6 else ''}); use a new sweep name or force=true")
    skip = "finished" if is_finished(job.run_dir) else live_job(job, resubmit_unknown)
    return Plan(job, render(job, cluster), config, total, skip)


def live_job(job: Job, resubmit_unknown: bool = False) -> str | None:
    """``"running: job N"`` / ``"pending: job N"`` when a recorded job of ``job``'s kind is still queued or running
    (every such job is named), else None. A recorded job whose state SLURM could not tell (:data:`UNKNOWN`) may be
    live: ``SweepError`` naming the commands that settle it, unless ``resubmit_unknown`` counts it as over."""
    states = job_states(job.run_dir, job.kind)
    unknown = [job_id for job_id, state in states if state == UNKNOWN]
    if unknown and not resubmit_unknown:
        raise SweepError(
            f"{job.name}: SLURM could not tell the state of job {', '.join(unknown)} (squeue missing, failing or not "
            f"answering, and no sacct record), so it may still be queued or running: check with squeue -j "
            f"{unknown[0]} or sacct -j {unknown[0]} and run the same command again once they answer, or add "
            "resubmit_unknown=true to submit anyway")
    live = active_jobs(states)
    if not live:
        return None
    return ", ".join(f"{ACTIVE[state]}: job {job_id}" for job_id, state in live)


@contextlib.contextmanager
def signals_held(signums: tuple[int, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)) -> Iterator[None]:
    """Hold back ``signums`` inside (Ctrl-C, ``kill``, a closed terminal) and act on them on leaving, as they would
    have been: a job that sbatch accepted is recorded before the process stops. Child processes get the default
    handling (an exec resets caught signals). Outside the main thread, a plain block."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    before = {s: signal.signal(s, lambda signum, _frame: caught.append(signum)) for s in signums}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
        for s in dict.fromkeys(caught):
            signal.raise_signal(s)


def submit(p: Plan) -> str:
    """``sbatch`` the job and, once sbatch has accepted it, freeze it into ``<run_dir>/submit/`` and record its id;
    returns the job id. A refused submission leaves the run directory as it was. SIGINT, SIGTERM and SIGHUP that
    arrive meanwhile take effect once the job is recorded (:func:`signals_held`)."""
    with signals_held():
        return _submit(p)


def _submit(p: Plan) -> str:
    from common import write_json_atomic
    from eval.results import git_commit

    if shutil.which("sbatch") is None:
        raise SweepError("sbatch is not on PATH: run this on a SLURM login node, or use --dry-run")
    out = p.job.run_dir / "submit"
    created = [d for d in (out, *out.parents) if not d.exists()]  # deepest first: removed again if sbatch refuses
    out.mkdir(parents=True, exist_ok=True)
    script = out / f"{p.job.kind}.sbatch"
    pending = script.with_name(f"{script.name}.pending")
    pending.write_text(p.script)
    try:
        # a session of its own: Ctrl-C at the terminal reaches this process (held), not sbatch mid-submission
        res = subprocess.run(["sbatch", "--parsable", str(pending)], capture_output=True, text=True,
                             start_new_session=True)
    except OSError as e:
        res = subprocess.CompletedProcess(e.filename or "sbatch", 127, "", str(e))
    job_id = res.stdout.strip().split(";")[0]
    if res.returncode != 0 or not job_id:
        pending.unlink(missing_ok=True)
        for d in created:
            d.rmdir()
        why = (res.stderr.strip().splitlines() or [f"exit status {res.returncode}, no job id"])[-1]
        raise SweepError(f"{p.job.name}: sbatch refused the job ({why}); nothing was frozen: fix the cause and run "
                         "the same command again")
    pending.replace(script)
    if p.config is not None:
        write_json_atomic(out / "config.json", p.config)
        write_json_atomic(out / "job.json", {
            "sweep": p.job.sweep, "experiment": p.job.experiment, "seed": p.job.seed,
            "overrides": list(p.job.overrides), "total_steps": p.total_steps, "git_commit": git_commit() or "unknown"})
    record_job(p.job.run_dir, {"job_id": job_id, "kind": p.job.kind})
    return job_id
