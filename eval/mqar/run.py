"""The MQAR grid: one job per ``(mixer, width, lr, seed)``, trained on the mixture of the settings and scored on
each, run by a pool of processes on one device.

Small models leave a GPU idle, so ``workers`` processes share it, each training a group of up to ``streams`` jobs
of one mixer and width side by side (one CUDA stream each, steps replayed from CUDA graphs), the longest first.
Every finished job is written to ``out/jobs/<job>.json`` (temp file, then ``os.replace``); a rerun skips jobs
whose file holds the same budget and settings, so an interrupted grid resumes where it stopped. The arms of an
experiment on the model's ``init`` and ``precision`` share ``out``: a job's name carries both where they are not the
defaults (:func:`arm_suffix`), so their files never collide, and a job they do not change (``precision`` of a mixer
that does not take it) is one file for every arm. An unfinished job
keeps its state after each epoch in ``out/partial/<job>.pt``, and a rerun continues it from there.
"""
from __future__ import annotations

import dataclasses
import datetime
import heapq
import json
import os
import platform
import re
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from common import write_json_atomic
from common.device import device_name, resolve_device
from eval.mqar.config import MQARConfig
from eval.mqar.data import MQARSetting
from eval.mqar.jobs import has_jobs, job_records
from eval.mqar.train import (
    DEFAULT_INIT,
    DEFAULT_PRECISION,
    ExampleBudget,
    JobRun,
    MixerChoice,
    architecture,
    arm_suffix,
    job_precision,
    train_together,
)
from eval.results import ROOT, git_commit

SCHEMA = 2
RUNS_FILE = "runs.jsonl"


@dataclass(frozen=True)
class Job:
    """One model of the grid, trained on ``budget``'s mixture and scored on each of ``settings``."""

    mixer: MixerChoice
    width: int
    lr: float
    seed: int
    budget: ExampleBudget
    settings: tuple[MQARSetting, ...]
    init: str = DEFAULT_INIT
    precision: str | None = None

    @property
    def name(self) -> str:
        """A file-name-safe identity, e.g. ``kdn_diag-mu-1_d64_lr0.002_s0``, ``kda_d128_lr0.0003_s0_init-authors``
        or ``kdn_diag_d128_lr0.0003_s0_init-authors_fp32``."""
        mixer = re.sub(r"[^A-Za-z0-9_.-]", "-", self.mixer.label)
        return f"{mixer}_d{self.width}_lr{self.lr:g}_s{self.seed}{arm_suffix(self.init, self.precision)}"

    @property
    def cost(self) -> float:
        """Relative work before any is measured: the width (every job trains the same tokens); see :func:`queue`."""
        return float(self.width)

    def identity(self) -> dict[str, Any]:
        """What the job's result depends on (a stored result with another identity is rerun): the grid's keys, the
        budget, the scored settings, the model (:func:`eval.mqar.train.architecture`), its ``init`` and its
        ``precision`` (``None`` where it does not apply)."""
        return {"mixer": self.mixer.label, "width": self.width, "lr": self.lr, "seed": self.seed,
                "init": self.init, "precision": self.precision,
                "budget": asdict(self.budget), "settings": [asdict(s) for s in self.settings],
                "model": architecture(self.mixer, self.width, self.budget.head_dim, self.budget.vocab_size)}


def build_jobs(cfg: MQARConfig) -> list[Job]:
    """The grid of ``cfg``, longest jobs first."""
    budget, settings = cfg.budget(), tuple(cfg.scored_settings())
    jobs = [Job(m, w, lr, seed, budget, settings, cfg.init,
                job_precision(m.name, dict(m.kwargs).get("precision", cfg.precision)))
            for m in cfg.mixer_choices() for w in cfg.widths for lr in cfg.lrs for seed in cfg.seeds]
    return sorted(jobs, key=lambda j: -j.cost)


def load_done(path: Path, job: Job) -> dict[str, Any] | None:
    """The stored result of ``job``, or ``None`` when missing, unreadable or from another budget or model.

    A job file whose identity has no ``model`` key is this job's when the rest of it matches and the parameter count
    the file records equals this model's; one without ``init`` and ``precision`` keys was trained at the defaults
    (fla's initialisation, the KDN mixers at ``bf16``)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    want, have = json.loads(json.dumps(job.identity())), record.get("identity")
    if isinstance(have, dict) and "init" not in have and "precision" not in have:
        have = {**have, "init": DEFAULT_INIT, "precision": job_precision(job.mixer.name, DEFAULT_PRECISION)}
    if isinstance(have, dict) and "model" not in have:
        have = {**have, "model": want["model"]} if record.get("params") == want["model"]["params"] else None
    return record if have == want else None


def flatten(job: dict[str, Any]) -> list[dict[str, Any]]:
    """A job's result as one record per setting: the setting's accuracies and state, with the job's fields."""
    common = {k: v for k, v in job.items() if k not in ("records", "curve", "identity")}
    return [{**common, **r} for r in job["records"]]


def partial_path(out: str | Path, job: Job) -> Path:
    """Where an unfinished job keeps its state after each epoch (:class:`JobRun`'s ``checkpoint``)."""
    return Path(out) / "partial" / f"{job.name}.pt"


def _run_group(args: tuple[list[Job], str, str, int, str | None, bool, str]) -> list[dict[str, Any]]:
    """In a pool process: train ``jobs`` together on ``device`` (:func:`train_together`), store each result and
    return them; a job that raises returns ``{"job": name, "error": ...}`` and stores nothing (a rerun tries it
    again). An error outside any one job (a CUDA fault surfacing in the clean-up) fails the group's jobs not
    stored yet, never the grid."""
    try:
        return _train_group(*args)
    except Exception as err:  # noqa: BLE001 - the other groups go on; this one's jobs are retried on a rerun
        jobs, out = args[0], args[2]
        return [{"job": job.name, "error": f"{type(err).__name__}: {err}"} for job in jobs
                if load_done(Path(out) / "jobs" / f"{job.name}.json", job) is None]


def _train_group(jobs: list[Job], device: str, out: str, threads: int, commit: str | None,
                 graphs: bool, curve: str) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)

    def progress(job: Job) -> Callable[[dict[str, Any]], None]:
        def show(point: dict[str, Any]) -> None:
            accs = " ".join(f"{s} {a:.3f}" for s, a in point["valid"].items())
            print(f"  {job.name} epoch {point['epoch']} ({point['s']:.0f}s): loss {point['loss']:.3f}, valid "
                  f"{accs}", flush=True)
        return show

    runs, failed = [], []
    for job in jobs:
        try:
            identity = job.identity()  # builds the model on the meta device: once per job
            runs.append((job, identity, JobRun(job.mixer, job.width, job.lr, job.seed, job.budget,
                                               list(job.settings), torch.device(device), progress(job), graphs,
                                               partial_path(out, job), identity, curve, job.init,
                                               job.precision)))
        except Exception as err:  # noqa: BLE001 - one broken mixer must not take the other jobs down with it
            failed.append({"job": job.name, "error": f"{type(err).__name__}: {err}"})
    results = []
    for (job, identity, _), res in zip(runs, train_together([run for _, _, run in runs])):
        if isinstance(res, BaseException):
            failed.append({"job": job.name, "error": f"{type(res).__name__}: {res}"})
            continue
        res["job"], res["identity"], res["git_commit"] = job.name, identity, commit
        res["device"] = device_name(torch.device(device))
        write_json_atomic(Path(out) / "jobs" / f"{job.name}.json", res)
        partial_path(out, job).unlink(missing_ok=True)
        results.append(res)
    return results + failed


def groups(jobs: list[Job], size: int) -> list[list[Job]]:
    """``jobs`` (longest first) in consecutive groups of at most ``size`` jobs of one ``(mixer, width)`` cell (its
    learning rates and seeds): a group trains in one process, its jobs stepped in turn, so it goes at the pace of
    its slowest job, and the jobs of one cell take the same time."""
    out: list[list[Job]] = []
    for job in jobs:
        if out and len(out[-1]) < size and (out[-1][0].mixer, out[-1][0].width) == (job.mixer, job.width):
            out[-1].append(job)
        else:
            out.append([job])
    return out


def measured_costs(out: Path, budget: ExampleBudget, device: str,
                   more: tuple[Path, ...] = ()) -> dict[tuple[str, int], float]:
    """Mean wall time (s) per ``(mixer, width)`` of the stored jobs that trained ``budget`` in one go on ``device``:
    those under ``out/jobs`` (a job file without a device counts as this one's), and for a cell that ``out`` lacks,
    those of the folders ``more``, as job files or a summary (:func:`eval.mqar.jobs.job_records`; their device must
    be named). Any rate or seed of a cell trains the same tokens through the same model, so another seed's time
    predicts this one's."""
    want, costs = json.loads(json.dumps(asdict(budget))), {}
    for folder, default in ((out, device), *((m, None) for m in more)):
        walls: dict[tuple[str, int], list[float]] = {}
        for job in job_records(folder).values():
            if (isinstance(job, dict) and job.get("wall_s") and not job.get("resumed_from")
                    and job.get("device", default) == device and (job.get("identity") or {}).get("budget") == want):
                walls.setdefault((job["mixer"], job["width"]), []).append(job["wall_s"])
        costs = {**{cell: sum(v) / len(v) for cell, v in walls.items()}, **costs}
    return costs


def time_folders(cfg: MQARConfig) -> tuple[Path, ...]:
    """``cfg.times`` as folders that hold jobs (job files or a summary): a relative path from the current directory,
    else from the repository root (where the shipped H200 times are)."""
    found = []
    for name in cfg.times:
        for path in (Path(name), ROOT / name):
            if has_jobs(path):
                found.append(path)
                break
    return tuple(found)


def cost_model(costs: dict[tuple[str, int], float]) -> Callable[[Job], float]:
    """A job's expected wall time (s) from ``costs`` (:func:`measured_costs`): its cell's, else its width times the
    measured cells' seconds per unit of width; with nothing measured, its width (a rank, not seconds)."""
    rate = sum(costs.values()) / sum(float(w) for _, w in costs) if costs else 1.0
    return lambda job: costs.get((job.mixer.label, job.width), rate * job.cost)


def queue(todo: list[Job], cost: Callable[[Job], float]) -> list[Job]:
    """``todo`` longest first by ``cost`` (:func:`cost_model`), so that the last groups to start are short ones."""
    return sorted(todo, key=lambda j: -cost(j))


def expected_wall(tasks: list[list[Job]], cost: Callable[[Job], float], workers: int) -> float:
    """When the last of ``tasks`` would end if each group took its first job's ``cost`` and they went in order to
    the first free of ``workers`` processes, as the pool hands them out: the grid's time (s) at the concurrency
    that the measured jobs ran at."""
    free = [0.0] * workers
    for group in tasks:
        heapq.heappush(free, heapq.heappop(free) + cost(group[0]))
    return max(free)


def stored(cfg: MQARConfig) -> tuple[list[dict[str, Any]], list[Job]]:
    """The results of ``cfg``'s jobs stored under ``cfg.out`` (same identity), and the jobs that have none."""
    results, todo = [], []
    for job in build_jobs(cfg):
        done = load_done(Path(cfg.out) / "jobs" / f"{job.name}.json", job)
        if done is None:
            todo.append(job)
        else:
            results.append(done)
    return results, todo


def _exit_on_signal(signum: int, _frame: Any) -> None:
    raise SystemExit(f"mqar: stopped by signal {signum}; rerun the same command to resume")


def run_grid(cfg: MQARConfig, log: Any = print) -> tuple[list[dict[str, Any]], list[dict[str, str]]]:
    """Run every job of ``cfg`` not already stored under ``cfg.out`` (each result keeps the commit it ran at).
    Returns the job results of the grid (:func:`flatten` gives one record per setting) and the jobs that failed
    (``{"job", "error"}``)."""
    device = resolve_device(cfg.device)
    results, todo = stored(cfg)
    total, out, failed = len(results) + len(todo), Path(cfg.out), []
    if not cfg.train:
        log(f"mqar: {total} jobs, {len(results)} stored under {out}, {len(todo)} missing (train=false: none run)")
        return results, failed
    streams = cfg.streams or (3 if device.type == "cuda" else 1)
    budget = cfg.budget()
    costs = measured_costs(out, budget, device_name(device), time_folders(cfg))
    cost = cost_model(costs)
    tasks = groups(queue(todo, cost), streams)
    workers = min(cfg.workers or (6 if device.type == "cuda" else 1), max(1, len(tasks)))
    order = (f"about {expected_wall(tasks, cost, workers):.0f} s by the measured times of {len(costs)} cells, "
             "longest first" if costs else "longest first by width")
    log(f"mqar: {total} jobs ({len(results)} stored, {len(todo)} to run) on {device} with {workers} worker(s) "
        f"x {streams} stream(s){', CUDA graphs' if cfg.graphs and device.type == 'cuda' else ''}; each trains "
        f"{budget.epochs} x {budget.steps_per_epoch()} steps, {budget.tokens() / 1e6:.1f}M tokens; {order}")
    commit = git_commit()
    args = [(group, str(device), str(out), cfg.threads, commit, cfg.graphs, cfg.curve) for group in tasks]
    t0, stored_before, stopped = time.perf_counter(), len(results), None
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    # SIGTERM (a scheduler's time limit, `timeout`) would end this process without unwinding, and the workers,
    # orphaned, would train on beside the next run; as an exception it reaches the pool's clean-up below. While the
    # pool starts it is held (raised then, it would leave the workers started so far to no one) and acts after.
    main = threading.current_thread() is threading.main_thread()
    held: list[int] = []
    on_term = signal.signal(signal.SIGTERM, lambda signum, _frame: held.append(signum)) if main else None
    pool = None
    try:
        # one process per group: a CUDA fault is sticky in its process, so it fails that group alone, and a
        # finished group's graph pools and cached blocks go back to the GPU with its process
        pool = torch.multiprocessing.get_context("spawn").Pool(workers, maxtasksperchild=1) if workers > 1 else None
        if main:
            signal.signal(signal.SIGTERM, _exit_on_signal)  # runs the held handler first for a signal pending now
            if held:
                _exit_on_signal(held[0], None)
        done_iter = map(_run_group, args) if pool is None else pool.imap_unordered(_run_group, args)
        i = 0
        for batch in done_iter:
            for res in batch:
                i += 1
                head = f"[{i}/{len(todo)} {time.perf_counter() - t0:.0f}s]"
                if "error" in res:
                    failed.append(res)
                    log(f"{head} {res['job']} FAILED: {res['error']}")
                    continue
                results.append(res)
                accs = " ".join(f"{r['setting']} {r['test_acc']:.3f}" for r in res["records"])
                log(f"{head} {res['mixer']} d{res['width']} lr {res['lr']:g} seed {res['seed']}: test {accs}; "
                    f"loss {res['final_loss']:.3f}{' (diverged)' if res['diverged'] else ''} "
                    f"({res['wall_s']:.0f}s, {res['tokens'] / max(res['train_s'], 1e-9) / 1e6:.2f}M tok/s"
                    f"{'' if res['graph_fallback'] is None else '; eager: ' + res['graph_fallback']})")
    except BaseException as err:
        stopped = f"{type(err).__name__}: {err}"
        if pool is not None:
            pool.terminate()  # stop the workers now: their finished epochs are checkpointed already
        raise
    finally:
        if pool is not None:
            pool.close()
            pool.join()
        if on_term is not None:
            signal.signal(signal.SIGTERM, on_term)
        if todo:
            record_run(out, {"date": started, "wall_s": time.perf_counter() - t0, "device": device_name(device),
                             "git_commit": commit, "to_run": len(todo), "trained": len(results) - stored_before,
                             "failed": len(failed), "stopped": stopped})
    return results, failed


def record_run(out: Path, run: dict[str, Any]) -> None:
    """Append ``run`` (one training command on ``out``) to ``out/runs.jsonl``, so that a grid filled by several
    runs (a time limit and reruns, or a split by width) states the time all of them took (:func:`runs_of`)."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / RUNS_FILE, "a") as f:
        f.write(json.dumps(run) + "\n")


def runs_of(out: str | Path) -> list[dict[str, Any]]:
    """The training runs recorded under ``out`` (:func:`record_run`), oldest first; unreadable lines are skipped."""
    try:
        lines = (Path(out) / RUNS_FILE).read_text().splitlines()
    except OSError:
        return []
    runs = []
    for line in lines:
        try:
            runs.append(json.loads(line))
        except ValueError:
            continue
    return runs


def summarize(records: list[dict[str, Any]], cfg: MQARConfig) -> list[dict[str, Any]]:
    """One row per ``(setting, mixer, width)`` of the per-setting ``records`` (:func:`flatten`): the learning rate
    with the best mean validation accuracy over seeds, and at that rate the test accuracy's mean, std (over seeds,
    ``ddof = 1``; 0 for one seed) and values."""
    cells: dict[tuple, dict[float, list[dict]]] = {}
    for r in records:
        cells.setdefault((r["setting"], r["mixer"], r["width"]), {}).setdefault(r["lr"], []).append(r)
    order = {s: i for i, s in enumerate(cfg.scored_names())}, {m: i for i, m in enumerate(cfg.mixers)}
    rows = []
    for (setting, mixer, width), by_lr in sorted(cells.items(), key=lambda kv: (
            order[0].get(kv[0][0], 99), order[1].get(kv[0][1], 99), kv[0][2])):
        sweep = {lr: sum(r["valid_acc"] for r in rs) / len(rs) for lr, rs in by_lr.items()}
        best = max(sorted(sweep), key=lambda lr: sweep[lr])
        runs = sorted(by_lr[best], key=lambda r: r["seed"])
        accs = [r["test_acc"] for r in runs]
        mean = sum(accs) / len(accs)
        std = (sum((a - mean) ** 2 for a in accs) / (len(accs) - 1)) ** 0.5 if len(accs) > 1 else 0.0
        first = runs[0]
        rows.append({"setting": setting, "mixer": mixer, "width": width, "state": first["state"],
                     "state_recurrent": first["state_recurrent"], "params": first["params"], "best_lr": best,
                     "test_acc_mean": mean, "test_acc_std": std, "test_acc": accs, "seeds": [r["seed"] for r in runs],
                     "valid_acc_by_lr": {f"{lr:g}": v for lr, v in sorted(sweep.items())},
                     "diverged_lrs": sorted(f"{lr:g}" for lr, rs in by_lr.items() if any(r["diverged"] for r in rs))})
    return rows


def header(cfg: MQARConfig, wall_s: float, commit: str | None) -> dict[str, Any]:
    """Device, versions, date, ``commit`` (read when the run starts), command and every setting of the run. The
    versions of triton and fla are their distributions' (``None`` where not installed): importing fla to ask would
    define its hundreds of Triton kernels, seconds of a CPU run that launches none of them."""
    import transformers

    def installed(dist: str) -> str | None:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return None

    device = resolve_device(cfg.device)
    name = device_name(device)
    return {
        "schema": SCHEMA, "benchmark": "mqar", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds"), "git_commit": commit, "command": " ".join(["python -m eval.mqar",
                                                                                 *sys.argv[1:]]),
        "device": {"type": device.type, "name": name, "cpu_count": os.cpu_count()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "triton": installed("triton"),
                     "fla": installed("flash-linear-attention"), "transformers": transformers.__version__},
        "config": dataclasses.asdict(cfg), "wall_s": wall_s,
        "state_matching": ("state = recurrent memory per sequence summed over the two layers, in elements "
                           "(models.recurrent_state_size). Every matrix-state mixer has width/head_dim heads of "
                           "head_dim x head_dim (heads x head_dim^2 per layer); Diagonal KDN adds heads x head_dim "
                           "precisions and Isotropic KDN heads; Mamba-3's d_state = heads x head_dim^2 / (expand x "
                           "width) makes its expand x width x d_state the same. Attention's entry is its KV cache "
                           "at the setting's length (2 x T x width per layer), which grows with T: not matched."),
    }
