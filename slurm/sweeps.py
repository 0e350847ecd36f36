"""Named sweeps (``conf/sweep/*.yaml``) expanded into jobs, each with its run directory and overrides.

A training sweep lists experiment presets (``conf/experiment/``); ``seeds=N`` repeats every one over training seeds
0..N-1 (``seed=k``, the model initialisation; the data order, ``data.seed``, stays shared as the paper's protocol
asks). The run directory is deterministic, ``<runs_root>/<sweep>/<experiment>/seed<k>``, so a resubmitted or
requeued job resumes its own checkpoint. The ``eval`` sweep runs the evaluation suites over the finished runs of
another sweep (``of=<sweep>``).
"""
from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

from omegaconf import OmegaConf

ROOT = Path(__file__).resolve().parents[1]
SWEEPS = ROOT / "conf" / "sweep"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class SweepError(ValueError):
    """A sweep, its settings or its overrides are wrong; the message names the fix."""


@dataclass(frozen=True)
class Job:
    """One SLURM job: a training run (``train.py``) or the evaluation of one (``evaluate.py``)."""

    sweep: str
    kind: str  # "train" or "eval"
    experiment: str
    seed: int
    run_dir: Path
    overrides: tuple[str, ...] = field(default=())

    @property
    def name(self) -> str:
        """SLURM job name and run name: ``<sweep>-<experiment>-seed<k>`` (``eval-`` first for evaluations)."""
        base = f"{self.sweep}-{self.experiment}-seed{self.seed}"
        return f"eval-{base}" if self.kind == "eval" else base

    def command(self) -> list[str]:
        """The job's program and arguments, as the batch script runs them on every node."""
        if self.kind == "train":
            return [sys.executable, "-m", "slurm.launch", "train.py", *self.overrides]
        return [sys.executable, "evaluate.py", *self.overrides]


def available() -> list[str]:
    """Names of the sweeps in ``conf/sweep/``."""
    return sorted(p.stem for p in SWEEPS.glob("*.yaml"))


def load_sweep(name: str) -> dict:
    """The sweep's YAML as a dict; ``SweepError`` naming the known sweeps for an unknown name."""
    path = SWEEPS / f"{name}.yaml"
    if not path.is_file():
        raise SweepError(f"unknown sweep {name!r}; known sweeps: {', '.join(available())} (conf/sweep/*.yaml)")
    spec = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    if spec.get("kind") not in ("train", "eval"):
        raise SweepError(f"{path}: kind must be 'train' or 'eval', got {spec.get('kind')!r}")
    return spec


def run_dir_of(runs_root: Path, sweep: str, experiment: str, seed: int) -> Path:
    """``<runs_root>/<sweep>/<experiment>/seed<k>``."""
    return runs_root / sweep / experiment / f"seed{seed}"


def latest_step(run_dir: Path) -> int | None:
    """Step of the newest complete checkpoint (``checkpoints/step_N``), or ``None``."""
    steps = [int(m.group(1)) for p in (run_dir / "checkpoints").glob("step_*") if (m := _STEP_DIR.match(p.name))]
    return max(steps, default=None)


def is_finished(run_dir: Path) -> bool:
    """A run is finished when its frozen submission records ``total_steps`` and a checkpoint reached it."""
    frozen = run_dir / "submit" / "job.json"
    if not frozen.is_file():
        return False
    total = json.loads(frozen.read_text()).get("total_steps")
    step = latest_step(run_dir)
    return total is not None and step is not None and step >= total


def restart_reason(run_dir: Path | str) -> str | None:
    """Why training in ``run_dir`` may start over from step 0 although it left records there: its metrics stop
    within the first checkpoint interval (at most ``trainer.ckpt_every > 0`` steps, read from the run's
    ``config.yaml``) and ``checkpoints/`` holds nothing (no checkpoint, no temp or damaged one), so no checkpoint was
    ever written and no trained state can be lost. ``None`` when nothing needs it (no records) or when the records
    call for a person (a checkpoint was due, or the config is unreadable): train.py then stops and asks for
    ``resume=restart``."""
    run_dir = Path(run_dir)
    metrics, ckpts = run_dir / "metrics.jsonl", run_dir / "checkpoints"
    if not metrics.is_file() or not metrics.stat().st_size or (ckpts.exists() and any(ckpts.iterdir())):
        return None
    try:
        every = int(OmegaConf.load(run_dir / "config.yaml").trainer.ckpt_every)
    except Exception:  # noqa: BLE001 - missing, unreadable or without the key: a person decides
        return None
    if every <= 0:  # checkpoints only at the end or on a signal: no interval bounds what a restart would redo
        return None
    steps = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line torn by the failure
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            steps.append(rec["step"])
    last = max(steps, default=0)
    if last > every:
        return None
    return (f"{run_dir} stopped at step {last}, before its first checkpoint (every {every} steps), and holds no "
            "checkpoint")


def expand(name: str, *, seeds: int, runs_root: Path, overrides: list[str], of: str | None = None) -> list[Job]:
    """The jobs of sweep ``name``: every experiment x seed (training), or every finished run of sweep ``of``.

    Args:
        name: a sweep in ``conf/sweep/``.
        seeds: training seeds per experiment (>= 1).
        runs_root: the folder that holds every sweep's run directories.
        overrides: Hydra overrides added to every training job (or to every evaluation job for ``eval``).
        of: for an ``eval`` sweep, the training sweep whose finished runs it evaluates.
    Returns:
        The jobs, in the sweep's order, seeds innermost.
    """
    if seeds < 1:
        raise SweepError(f"seeds={seeds}: give at least one training seed (seeds=1 is the paper's protocol)")
    spec = load_sweep(name)
    if spec["kind"] == "train":
        if of is not None:
            raise SweepError(f"of={of} only applies to the eval sweep; drop it for {name}")
        jobs = []
        for exp in spec["experiments"]:
            for k in range(seeds):
                run_dir = run_dir_of(runs_root, name, exp, k)
                jobs.append(Job(name, "train", exp, k, run_dir, (f"experiment={exp}", f"seed={k}",
                                                                 f"name={name}-{exp}-seed{k}", f"run_dir={run_dir}",
                                                                 *overrides)))
        return jobs
    if of is None:
        raise SweepError(f"the {name} sweep evaluates another sweep's runs: add of=<sweep> (one of "
                         f"{', '.join(s for s in available() if load_sweep(s)['kind'] == 'train')})")
    suites = ",".join(spec["suites"])
    jobs = []
    for train_job in expand(of, seeds=seeds, runs_root=runs_root, overrides=[]):
        if is_finished(train_job.run_dir):
            jobs.append(Job(of, "eval", train_job.experiment, train_job.seed, train_job.run_dir,
                            (f"model={train_job.run_dir}", f"suites=[{suites}]", f"preset={spec['preset']}",
                             *overrides)))
    return jobs
