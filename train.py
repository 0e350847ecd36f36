"""Pretrain a KDN (or baseline) language model with the paper's protocol (docs/protocol.md §8).

    python train.py                                   # README main job: small KDN, embedded corpus, CPU
    python train.py model=toy trainer.max_steps=30    # a short run
    python train.py experiment=table1_750m_kdn_diag   # one paper row
    python train.py -m experiment=table4_mu_1,table4_mu_dk   # a local multirun (SLURM: docs/sweeps.md)
    accelerate launch --num_processes 2 train.py ...  # DDP; add trainer.distributed=fsdp for FSDP2

Everything a run writes lives in ``run_dir`` (``runs/<name>`` by default; the default name holds the
experiment-changing overrides): ``config.yaml`` (the validated config), ``fingerprint.json`` (the experiment's
identity), ``.hydra/`` (Hydra's composed config and the command's overrides), ``checkpoints/``, ``metrics.jsonl``,
``hf/`` (the Hugging Face export), wandb's offline files and, while it runs, ``run.lock``. A command that is refused
(a bad value, another experiment, a checkpoint it cannot resume) leaves these as they were (a damaged checkpoint it
finds is still set aside): they are written once its checks have passed and its checkpoint is loaded. Rerunning the
same command resumes from the newest intact checkpoint there (a finished run says so and trains nothing); a rerun
with another experiment's settings, ``trainer.max_steps`` included, is refused (``name=<new>`` starts another run,
``resume=force`` continues this one with the new settings). A directory whose training left records but no intact
checkpoint is started over only with ``resume=restart``, which keeps the old ``metrics.jsonl`` as
``metrics.<time>.jsonl``. SIGUSR1/SIGTERM save at the next step boundary (during start-up: at once) and exit with
code 75 for a requeue; a NaN/Inf loss, gradient norm or weight stops the run and keeps the last good checkpoint. Bad
options and run-directory conflicts end in one line and exit code 2; a checkpoint that cannot be written or read
ends in one line and exit code 1.
"""
from __future__ import annotations

if __name__ == "__main__":  # a preemption signal during the imports below exits 75 for a requeue, too
    from trainer.preemption import exit_on_signals

    exit_on_signals()

import itertools  # noqa: E402
import logging  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import uuid  # noqa: E402
from dataclasses import asdict  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import hydra  # noqa: E402
import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.utils import broadcast_object_list, set_seed  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from common import write_text_atomic  # noqa: E402
from data import PrepareConfig, TokenLoader, check_tokenizer, load_tokenizer, prepare, read_meta  # noqa: E402
from data.pipeline import os_error_line  # noqa: E402
from data.shards import sha256_file  # noqa: E402
from kdn.modules import cached_weight_casts  # noqa: E402
from models import build_model, count_flops_per_token  # noqa: E402
from trainer.checkpoint import (  # noqa: E402
    MANIFEST,
    Checkpointer,
    CheckpointError,
    TrainState,
    export_hf,
    export_problem,
)
from trainer.config import (  # noqa: E402
    ConfigError,
    StepBudget,
    TrainConfig,
    build_model_config,
    check_override_keys,
    derive_budget,
    load_config,
)
from trainer.distributed import build_accelerator, world_size  # noqa: E402
from trainer.metrics import MetricLogger, peak_flops  # noqa: E402
from trainer.optim import adopt_hyperparameters, all_finite, build_optimizer, build_scheduler, sync_lr  # noqa: E402
from trainer.preemption import Preemption  # noqa: E402
from trainer.profiling import StepProfiler  # noqa: E402
from trainer.rundir import (  # noqa: E402
    HYDRA_SUBDIR,
    RunDirError,
    RunLock,
    check_fingerprint,
    earlier_training,
    set_aside_records,
    store_fingerprint,
)

log = logging.getLogger("train")


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/Inf; the step was not applied."""


class NonFiniteWeightsError(RuntimeError):
    """A parameter (or optimiser state) became NaN/Inf in an optimiser step; that state was not saved."""


class DataPrepareError(RuntimeError):
    """The shards could not be written (a full disk, a read-only directory); the message is one line."""


_ADVICE = ("Lower optim.lr or raise optim.warmup_frac (add resume=force to continue this run with the new "
           "settings), or inspect the data at this step.")


def _names(xs: list[str]) -> str:
    return ", ".join(xs[:5]) + (f" (+{len(xs) - 5} more)" if len(xs) > 5 else "") if xs else "none"


def diagnose_non_finite(model: torch.nn.Module, step: int, what: str, lr: float, last_ckpt: Path | None) -> str:
    """One paragraph: where it happened, which parameters carry NaN/Inf gradients or values, what to do."""
    bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    bad_params = [n for n, p in model.named_parameters() if not p.isfinite().all()]
    return (f"non-finite training loss at step {step} ({what}, lr={lr:.3e}); "
            f"non-finite gradients in: {_names(bad_grads)}; non-finite parameters: {_names(bad_params)}. "
            f"The update was not applied and no checkpoint was written; last good checkpoint: "
            f"{last_ckpt or 'none yet'}. {_ADVICE}")


def non_finite_flag(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> torch.Tensor:
    """0-d float tensor on the parameters' device, 1 if a parameter (or, given ``optimizer``, a floating optimiser
    state) holds NaN/Inf on this process, else 0. One fused reduction; no host sync."""
    tensors = list(model.parameters())
    if optimizer is not None:
        tensors += [v for s in optimizer.state.values() for v in s.values()
                    if torch.is_tensor(v) and v.is_floating_point()]
    return (~all_finite(tensors)).float()


def weights_finite(accelerator: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> bool:
    """Collective: whether ``non_finite_flag`` is 0 on every process (one small all-reduce and a sync)."""
    bad = non_finite_flag(model, optimizer).reshape(1).to(accelerator.device)
    return float(accelerator.reduce(bad, "sum")) == 0


def diagnose_weights(model: torch.nn.Module, step: int, lr: float, last_ckpt: Path | None) -> str:
    """One paragraph for non-finite weights after the optimiser step of ``step``."""
    bad = _names([n for n, p in model.named_parameters() if not p.isfinite().all()])
    where = "the optimiser state" if bad == "none" else bad
    return (f"non-finite weights after the optimiser step of step {step} (lr={lr:.3e}); in: {where}. "
            f"This state was not saved; last good checkpoint: {last_ckpt or 'none yet'}. {_ADVICE}")


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


@torch.no_grad()
def evaluate(model: torch.nn.Module, accelerator: Accelerator, loader: TokenLoader, n_batches: int) -> float:
    """Mean validation loss over the first ``n_batches`` micro-batches of the (unshuffled) val split, counted
    over all processes: each of W runs ``ceil(n_batches / W)``, which with the loader's rank blocks covers the
    same windows at any world size (when W divides ``n_batches``) and at every evaluation."""
    model.eval()
    total, n = torch.zeros((), device=accelerator.device), 0
    for batch in itertools.islice(loader, -(-n_batches // accelerator.num_processes)):
        total += model(**to_device(batch, accelerator.device)).loss.float()
        n += 1
    model.train()
    return float(accelerator.reduce(total, "sum")) / (n * accelerator.num_processes)


def train(cfg: TrainConfig, hydra_files: dict[str, str] | None = None) -> dict[str, Any]:
    """Run (or resume) one training job; returns a summary of where it ended. The preemption signals
    are caught from the start (a signal during set-up is acted on at the first step boundary). ``hydra_files``
    ({name: text}) are written to ``<run_dir>/.hydra/`` with the run's other records, once the command is
    accepted."""
    with Preemption(cfg.trainer.preempt_signals) as preemption:
        budget = derive_budget(cfg, world_size(cfg.trainer))
        accelerator, precision = build_accelerator(cfg.trainer, budget.grad_accum)
        if not accelerator.is_main_process:
            log.setLevel(logging.WARNING)
            return _train(cfg, preemption, accelerator, precision, budget, token="", hydra_files={})
        with RunLock(cfg.run_dir) as lock:  # one process a run directory
            return _train(cfg, preemption, accelerator, precision, budget, token=lock.me["token"][:8],
                          hydra_files=hydra_files or {})


def _check_run_dir(cfg: TrainConfig, last: Path | None) -> tuple[dict[str, list[Any]], str]:
    """Refuse a resume of another experiment (unless ``resume=force``) and a start over the records of earlier
    training (unless ``resume=restart``). Writes nothing. Returns the adopted changes ({key: [old, new]}) of a
    forced resume and the earlier training that ``resume=restart`` sets aside ("" when none)."""
    run_dir = Path(cfg.run_dir)
    earlier = "" if last is not None else earlier_training(run_dir)
    if earlier and cfg.resume != "restart":
        raise RunDirError(f"{run_dir} holds earlier training ({earlier}) but no intact checkpoint to resume from; "
                          "add resume=restart to start it over (its metrics are kept aside), or use another name=")
    if last is not None and cfg.resume == "restart":
        log.warning(f"resume=restart: {run_dir} has the intact checkpoint {last}, so it resumes from it (restart "
                    "starts over only a run without one; use another name= to start afresh)")
    changes = check_fingerprint(run_dir, asdict(cfg), cfg.resume == "force") if last is not None else {}
    return changes, earlier


def _record_run(cfg: TrainConfig, accelerator: Accelerator, ckpt: Checkpointer, earlier: str,
                hydra_files: dict[str, str]) -> None:
    """Collective, once the command is accepted: set aside the records of ``earlier`` training, remove the temp
    directories of interrupted saves, and write this run's validated config (``config.yaml``), its identity
    (``fingerprint.json``) and ``hydra_files`` (into ``.hydra/``)."""
    run_dir = Path(cfg.run_dir)
    accelerator.wait_for_everyone()  # every process compared with the stored config before it is replaced
    if accelerator.is_main_process:
        run_dir.mkdir(parents=True, exist_ok=True)
        if earlier:
            kept = ", ".join(p.name for p in set_aside_records(run_dir))
            log.warning(f"resume=restart: {run_dir} starts over from step 0 ({earlier}); the earlier records are "
                        f"kept as {kept or 'they were'}")
        ckpt.remove_stale_temps()
        if (partial := run_dir / ".tmp_hf").exists():  # an export that was killed; the next export rewrites it
            log.warning(f"removing {partial}, the remains of an interrupted export")
            shutil.rmtree(partial)
        write_text_atomic(run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        store_fingerprint(run_dir, asdict(cfg))
        for name, text in hydra_files.items():
            write_text_atomic(run_dir / HYDRA_SUBDIR / name, text)


def _train(cfg: TrainConfig, preemption: Preemption, accelerator: Accelerator, precision: str, budget: StepBudget,
           token: str, hydra_files: dict[str, str]) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if world > 1:  # the temp directory of a save is named the same on every process
        token = broadcast_object_list([token])[0]
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.trainer.keep_last, token)
    last = ckpt.resume_point(accelerator)  # damaged checkpoints are set aside before anything is decided
    changes, earlier = _check_run_dir(cfg, last)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    # data: one global token stream, the same for every mixer with the same data.seed
    if cfg.data.auto_prepare:
        with accelerator.main_process_first():  # the first process tokenises; the others find the shards
            try:
                shard_dir = prepare(PrepareConfig(**cfg.data.prepare))
            except OSError as e:  # a full disk, a read-only directory: one line, the finished chunks kept
                raise DataPrepareError(f"data.prepare: {os_error_line(e)}") from None
    else:
        shard_dir = Path(cfg.data.prepare["out_dir"])
    try:  # the tokenizer exported with the model is the one the shards were made with
        tokenizer = load_tokenizer(cfg.data.prepare.get("tokenizer") or read_meta(shard_dir)["tokenizer"]["name"])
        check_tokenizer(shard_dir, tokenizer)
    except ValueError as e:
        raise ConfigError(f"data.prepare.tokenizer: {e}") from None
    loader_kw = dict(seq_len=cfg.data.seq_len, batch_size=cfg.trainer.micro_batch_size, seed=cfg.data.seed,
                     rank=rank, world_size=world, varlen=cfg.data.varlen)
    loader = TokenLoader(shard_dir, split="train", num_workers=cfg.data.num_workers,
                         pin_memory=device.type == "cuda", reshard=cfg.trainer.reshard, **loader_kw)
    val_loader = TokenLoader(shard_dir, split="val", **loader_kw)

    # model, optimiser, schedule
    set_seed(cfg.seed)
    model_cfg = build_model_config(cfg, loader.vocab_size)
    model = build_model(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    o = cfg.optim
    hyper = dict(lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    optimizer = build_optimizer(model, **hyper)
    scheduler = build_scheduler(optimizer, warmup_steps=budget.warmup_steps, total_steps=budget.total_steps,
                                min_ratio=o.min_lr_ratio)
    model, optimizer = accelerator.prepare(model, optimizer)

    # resume from the run directory's newest intact checkpoint, if any
    state = TrainState(world_size=world, wandb_id=uuid.uuid4().hex[:8])
    resumed = False
    if last is not None:
        state = ckpt.load(accelerator, last, reshard=cfg.trainer.reshard)
        state.world_size = world
        scheduler.load_state_dict(state.scheduler)
        if changes:  # resume=force: the new optimiser and schedule settings replace the restored ones
            adopt_hyperparameters(optimizer, scheduler, **hyper)
        sync_lr(optimizer, scheduler)  # the schedule of this config's step count applies from the first step
        loader.load_state_dict(state.loader)
        resumed = True
    _record_run(cfg, accelerator, ckpt, earlier, hydra_files)  # accepted: nothing refuses the command after this
    already_done = state.step >= budget.total_steps
    if already_done:
        log.info(f"{run_dir} is finished: step {state.step} of {budget.total_steps} ({last}); nothing to train")
    else:
        if resumed:
            log.info(f"resumed from {last} (step {state.step}, {state.tokens_seen:,} tokens)")
        log.info(f"{cfg.name}: {n_params / 1e6:.1f}M parameters, {budget.total_steps} steps of "
                 f"{budget.tokens_per_step:,} tokens ({world} process(es) x {budget.grad_accum} accumulation x "
                 f"{cfg.trainer.micro_batch_size} x {cfg.data.seq_len}), warm-up {budget.warmup_steps}, {precision}")

    def save(lr: float) -> Path:
        """Checkpoint the state after the optimiser step of ``state.step``, taken with ``lr``."""
        if not weights_finite(accelerator, model, optimizer):  # never a non-finite checkpoint
            raise NonFiniteWeightsError(diagnose_weights(accelerator.unwrap_model(model), state.step, lr,
                                                         ckpt.latest()))
        state.scheduler = scheduler.state_dict()
        state.loader = loader.state_dict()
        return ckpt.save(accelerator, state)

    flops_per_token = count_flops_per_token(model_cfg, cfg.data.seq_len)
    peak = peak_flops(device, precision, cfg.trainer.peak_flops)
    profiler = StepProfiler(run_dir / "profile", cfg.logging.profile.start, cfg.logging.profile.steps,
                            accelerator.is_main_process, device)
    loss = val_loss = float("nan")
    with MetricLogger(
            run_dir, enabled=accelerator.is_main_process, resume_step=state.step, total_steps=budget.total_steps,
            progress=cfg.logging.progress, wandb_mode=cfg.logging.wandb.mode, wandb_project=cfg.logging.wandb.project,
            wandb_entity=cfg.logging.wandb.entity, wandb_id=state.wandb_id, run_name=cfg.name, config=asdict(cfg),
    ) as metrics:
        if resumed and changes:
            log.warning(f"resume=force: step {state.step} continues with "
                        + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in changes.items()))
            metrics.event({"step": state.step, "event": "resume_force", "changes": changes})
        batches = iter(loader)
        t_last, steps_since, timed = time.perf_counter(), 0, True
        # the weights after step k are checked in step k + 1's collective (no sync of its own) and before a save
        weights_bad, prev_lr = torch.zeros((), device=device), float("nan")
        while state.step < budget.total_steps:
            # one optimiser step = grad_accum micro-batches per process
            profiler.step_begins(state.step)
            timed &= not profiler.active  # a log interval holding profiled steps reports no speed
            lr = scheduler.get_last_lr()[0]
            loss_sum = torch.zeros((), device=device)
            with cached_weight_casts():  # the micro-batches share one bf16 cast of the weights
                for _ in range(budget.grad_accum):
                    batch = to_device(next(batches), device)
                    with accelerator.accumulate(model):
                        micro_loss = model(**batch).loss
                        accelerator.backward(micro_loss)
                    loss_sum += micro_loss.detach().float()
            grad_norm = float(accelerator.clip_grad_norm_(model.parameters(), o.grad_clip))
            # one collective per step: the mean loss and whether any process got a preemption signal
            flag = torch.tensor(float(preemption.requested), device=device)
            loss, preempted, bad = accelerator.reduce(
                torch.stack([loss_sum / budget.grad_accum, flag, weights_bad.to(device)]), "sum").tolist()
            loss /= world
            if bad:  # the previous step's update, before this step's loss (computed from those weights)
                raise NonFiniteWeightsError(diagnose_weights(accelerator.unwrap_model(model), state.step, prev_lr,
                                                             ckpt.latest()))
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteLossError(diagnose_non_finite(
                    accelerator.unwrap_model(model), state.step + 1, f"loss={loss}, grad_norm={grad_norm}", lr,
                    ckpt.latest()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens_seen += budget.tokens_per_step
            every_w, prev_lr = cfg.trainer.check_weights_every, lr
            weights_bad = non_finite_flag(model) if every_w and state.step % every_w == 0 else weights_bad.zero_()
            steps_since += 1
            if (summary := profiler.step_ends(state.step)) is not None:
                log.info(f"profile of steps {cfg.logging.profile.start + 1}-{state.step}: {summary}")
                t_last, steps_since, timed = time.perf_counter(), 0, True  # the speed window restarts after it

            if state.step % cfg.logging.log_every == 0 or state.step == budget.total_steps:
                dt = time.perf_counter() - t_last
                tok_s = budget.tokens_per_step * steps_since / dt if timed and steps_since else None
                record = {"step": state.step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                          "tokens": state.tokens_seen, "tokens_per_s": tok_s,
                          "tokens_per_s_per_device": None if tok_s is None else tok_s / world,
                          "mfu": None if peak is None or tok_s is None else tok_s / world * flops_per_token / peak,
                          "eta_s": None if tok_s is None else (budget.total_steps - state.step) * dt / steps_since}
                if device.type == "cuda":
                    record["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                metrics.log(record)
                t_last, steps_since, timed = time.perf_counter(), 0, True
            metrics.advance(state.step)

            stop = bool(preempted) or state.step == cfg.trainer.stop_after
            done = state.step == budget.total_steps
            t_pause = time.perf_counter()  # evaluation and checkpoints stay out of tokens/s
            if done or (cfg.trainer.eval_every and state.step % cfg.trainer.eval_every == 0):
                val_loss = evaluate(model, accelerator, val_loader, cfg.trainer.eval_batches)
                metrics.log({"step": state.step, "val_loss": val_loss})
            every = cfg.trainer.ckpt_every
            if stop or (every >= 0 and done) or (every > 0 and state.step % every == 0):
                log.info(f"step {state.step}: checkpoint {save(lr)}")
            if preempted:
                log.warning(f"preemption signal: saved step {state.step}; exiting for a requeue")
                accelerator.end_training()
                preemption.handoff()  # raises SystemExit; the with-block closes the metrics
            if stop:
                break
            t_last += time.perf_counter() - t_pause

    finished = state.step >= budget.total_steps
    export = run_dir / "hf"
    stale = _stale_export(accelerator, export, state.step) if finished and already_done and cfg.trainer.export else ""
    if finished and cfg.trainer.export and (not already_done or stale):
        if stale:
            log.warning(f"{export} is not the export of step {state.step}: {stale}; exporting step {state.step}")
        if not weights_finite(accelerator, model, None):
            raise NonFiniteWeightsError(diagnose_weights(accelerator.unwrap_model(model), state.step, prev_lr,
                                                         ckpt.latest()))
        export_hf(accelerator, model, tokenizer, export, _export_record(ckpt.latest(), state))
        log.info(f"exported the model and tokenizer of step {state.step} to {export}")
    accelerator.end_training()
    accelerator.free_memory()  # a multirun's next job starts from an empty device
    return {"step": state.step, "tokens_seen": state.tokens_seen, "loss": loss, "val_loss": val_loss,
            "finished": finished, "checkpoint": ckpt.latest(), "export": export if export.is_dir() else None}


def _stale_export(accelerator: Accelerator, export: Path, step: int) -> str:
    """Collective: what makes ``export`` other than a whole export of the weights after ``step`` (checked by the
    main process, which tells the others), ``""`` when it is one."""
    found = [(export_problem(export, step) or "") if accelerator.is_main_process else ""]
    if accelerator.num_processes > 1:
        found = broadcast_object_list(found)
    return found[0]


def _export_record(latest: Path | None, state: TrainState) -> dict[str, Any]:
    """The ``export.json`` fields of an export of ``state``'s weights: step, tokens, and the checkpoint of that
    step with its manifest's SHA-256 (``None`` when no checkpoint holds that step)."""
    same = latest is not None and latest.name == f"step_{state.step:09d}"
    return {"step": state.step, "tokens": state.tokens_seen, "checkpoint": latest.name if same else None,
            "manifest_sha256": sha256_file(latest / MANIFEST) if same else None}


def discard_unused_run_dir(run_dir: Path) -> bool:
    """Remove ``run_dir`` if it holds only what Hydra wrote before the run was refused (an empty ``train.log``);
    returns whether it did. A directory with anything else is left as it is."""
    log_file = run_dir / "train.log"
    if not run_dir.is_dir() or any(p.name != "train.log" for p in run_dir.iterdir()):
        return False
    if log_file.is_file() and log_file.stat().st_size:
        return False
    shutil.rmtree(run_dir)
    return True


def hydra_record(task_cfg: DictConfig) -> dict[str, str]:
    """The files Hydra would write into ``<run_dir>/.hydra/`` before the job (``config.yaml``, ``hydra.yaml``,
    ``overrides.yaml``), as text. ``conf/config.yaml`` sets ``hydra.output_subdir: null``, so Hydra writes none
    itself and ``train`` writes these once the command is accepted."""
    return {"config.yaml": OmegaConf.to_yaml(task_cfg), "hydra.yaml": OmegaConf.to_yaml(HydraConfig.instance().cfg),
            "overrides.yaml": OmegaConf.to_yaml(HydraConfig.get().overrides.task)}


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    run_dir = Path(HydraConfig.get().runtime.output_dir)  # == run_dir; per-job subdir under -m
    hydra_files = hydra_record(dict_cfg)  # the config as composed, before run_dir is set to the path below
    dict_cfg.run_dir = str(run_dir)
    try:
        train(load_config(dict_cfg), hydra_files)
    except (ConfigError, RunDirError, CheckpointError, DataPrepareError, NonFiniteLossError,
            NonFiniteWeightsError) as e:
        line, code = refusal(e)
        if not isinstance(e, (NonFiniteLossError, NonFiniteWeightsError)):  # no directory left for nothing
            discard_unused_run_dir(run_dir)
        print(line, file=sys.stderr)
        raise SystemExit(code) from None


def refusal(err: Exception) -> tuple[str, int]:
    """The one line on stderr and the exit code of an error that ends ``train.py``: bad values, an impossible batch
    split or a missing device (config, 2); another experiment, earlier training or a live process in the run
    directory (run, 2); a full disk, every checkpoint damaged or a refused file (checkpoint, 1); shards that cannot
    be written (data, 1); a NaN/Inf loss, gradient or weight, the last good checkpoint kept (training, 1)."""
    kind, code = (("config", 2) if isinstance(err, ConfigError) else ("run", 2) if isinstance(err, RunDirError)
                  else ("checkpoint", 1) if isinstance(err, CheckpointError)
                  else ("data", 1) if isinstance(err, DataPrepareError) else ("training", 1))
    return f"{kind} error: {' '.join(str(err).split())}", code

if __name__ == "__main__":
    try:  # a typo in a plain override gets the schema's did-you-mean (Hydra's own message names no key to use)
        check_override_keys(sys.argv[1:])
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        raise SystemExit(2) from None
    main()
