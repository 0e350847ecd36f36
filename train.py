"""Pretrain a KDN (or baseline) language model with the paper's protocol (docs/protocol.md §8).

    python train.py                                   # README main job: small KDN, embedded corpus, CPU
    python train.py model=toy trainer.max_steps=30    # a short run
    python train.py experiment=table1_750m_kdn_diag   # one paper row
    python train.py -m experiment=table4_mu_1,table4_mu_dk   # a sweep (slurm/sweep.sh submits it to SLURM)
    accelerate launch --num_processes 2 train.py ...  # DDP; add trainer.distributed=fsdp for FSDP2

Everything a run writes lives in ``run_dir`` (``runs/<name>`` by default): ``config.yaml`` (the
validated config), ``checkpoints/``, ``metrics.jsonl``, ``hf/`` (the Hugging Face export) and
wandb's offline files. Rerunning the same command resumes from the newest checkpoint there.
SIGUSR1/SIGTERM save at the next step boundary and exit with code 75 for a requeue; a NaN/Inf loss
stops the run and keeps the last good checkpoint.
"""
from __future__ import annotations

import itertools
import logging
import math
import sys
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

import hydra
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf

from data import PrepareConfig, TokenLoader, load_tokenizer, prepare
from kdn.modules import cached_weight_casts
from models import build_model, count_flops_per_token
from trainer.checkpoint import Checkpointer, TrainState, export_hf
from trainer.config import ConfigError, TrainConfig, build_model_config, derive_budget, load_config
from trainer.distributed import build_accelerator, world_size
from trainer.metrics import MetricLogger, peak_flops
from trainer.optim import build_optimizer, build_scheduler
from trainer.preemption import Preemption
from trainer.profiling import StepProfiler

log = logging.getLogger("train")


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN/Inf; the step was not applied."""


def diagnose_non_finite(model: torch.nn.Module, step: int, what: str, lr: float, last_ckpt: Path | None) -> str:
    """One paragraph: where it happened, which parameters carry NaN/Inf gradients or values, what to do."""
    bad_grads = [n for n, p in model.named_parameters() if p.grad is not None and not p.grad.isfinite().all()]
    bad_params = [n for n, p in model.named_parameters() if not p.isfinite().all()]

    def names(xs: list[str]) -> str:
        return ", ".join(xs[:5]) + (f" (+{len(xs) - 5} more)" if len(xs) > 5 else "") if xs else "none"

    return (f"non-finite training loss at step {step} ({what}, lr={lr:.3e}); "
            f"non-finite gradients in: {names(bad_grads)}; non-finite parameters: {names(bad_params)}. "
            f"The update was not applied and no checkpoint was written; last good checkpoint: "
            f"{last_ckpt or 'none yet'}. Lower optim.lr or raise optim.warmup_frac, or inspect the data at "
            "this step; rerunning the command resumes from that checkpoint.")


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


def train(cfg: TrainConfig) -> dict[str, Any]:
    """Run (or resume) one training job; returns a summary of where it ended. The preemption signals
    are caught from the start (a signal during set-up is acted on at the first step boundary)."""
    with Preemption(cfg.trainer.preempt_signals) as preemption:
        return _train(cfg, preemption)


def _train(cfg: TrainConfig, preemption: Preemption) -> dict[str, Any]:
    run_dir = Path(cfg.run_dir)
    budget = derive_budget(cfg, world_size(cfg.trainer))
    accelerator, precision = build_accelerator(cfg.trainer, budget.grad_accum)
    if not accelerator.is_main_process:
        log.setLevel(logging.WARNING)
    rank, world, device = accelerator.process_index, accelerator.num_processes, accelerator.device
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    if accelerator.is_main_process:  # the validated, resolved config of this run
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))

    # data: one global token stream, the same for every mixer with the same data.seed
    if cfg.data.auto_prepare:
        with accelerator.main_process_first():  # the first process tokenises; the others find the shards
            shard_dir = prepare(PrepareConfig(**cfg.data.prepare))
    else:
        shard_dir = Path(cfg.data.prepare["out_dir"])
    loader_kw = dict(seq_len=cfg.data.seq_len, batch_size=cfg.trainer.micro_batch_size, seed=cfg.data.seed,
                     rank=rank, world_size=world, varlen=cfg.data.varlen)
    loader = TokenLoader(shard_dir, split="train", num_workers=cfg.data.num_workers,
                         pin_memory=device.type == "cuda", reshard=cfg.trainer.reshard, **loader_kw)
    val_loader = TokenLoader(shard_dir, split="val", **loader_kw)
    tokenizer = load_tokenizer(loader.meta["tokenizer"]["name"])

    # model, optimiser, schedule
    set_seed(cfg.seed)
    model_cfg = build_model_config(cfg, loader.vocab_size)
    model = build_model(model_cfg)
    n_params = sum(p.numel() for p in model.parameters())
    o = cfg.optim
    optimizer = build_optimizer(model, lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay, eps=o.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=budget.warmup_steps, total_steps=budget.total_steps,
                                min_ratio=o.min_lr_ratio)
    model, optimizer = accelerator.prepare(model, optimizer)

    # resume from the run directory's newest checkpoint, if any
    ckpt = Checkpointer(run_dir / "checkpoints", cfg.trainer.keep_last)
    state = TrainState(world_size=world, wandb_id=uuid.uuid4().hex[:8])
    if (last := ckpt.latest()) is not None:
        state = ckpt.load(accelerator, last, reshard=cfg.trainer.reshard)
        state.world_size = world
        scheduler.load_state_dict(state.scheduler)
        loader.load_state_dict(state.loader)
        log.info(f"resumed from {last} (step {state.step}, {state.tokens_seen:,} tokens)")
    log.info(f"{cfg.name}: {n_params / 1e6:.1f}M parameters, {budget.total_steps} steps of "
             f"{budget.tokens_per_step:,} tokens ({world} process(es) x {budget.grad_accum} accumulation x "
             f"{cfg.trainer.micro_batch_size} x {cfg.data.seq_len}), warm-up {budget.warmup_steps}, {precision}")

    def save() -> Path:
        state.scheduler = scheduler.state_dict()
        state.loader = loader.state_dict()
        return ckpt.save(accelerator, state)

    flops_per_token = count_flops_per_token(model_cfg, cfg.data.seq_len)
    peak = peak_flops(device, precision, cfg.trainer.peak_flops)
    profiler = StepProfiler(run_dir / "profile", cfg.logging.profile.start, cfg.logging.profile.steps,
                            accelerator.is_main_process, device)
    loss = val_loss = float("nan")
    already_done = state.step >= budget.total_steps
    with MetricLogger(
            run_dir, enabled=accelerator.is_main_process, resume_step=state.step, total_steps=budget.total_steps,
            progress=cfg.logging.progress, wandb_mode=cfg.logging.wandb.mode, wandb_project=cfg.logging.wandb.project,
            wandb_entity=cfg.logging.wandb.entity, wandb_id=state.wandb_id, run_name=cfg.name, config=asdict(cfg),
    ) as metrics:
        batches = iter(loader)
        t_last, steps_since, timed = time.perf_counter(), 0, True
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
            loss, preempted = accelerator.reduce(torch.stack([loss_sum / budget.grad_accum, flag]), "sum").tolist()
            loss /= world
            if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                raise NonFiniteLossError(diagnose_non_finite(
                    accelerator.unwrap_model(model), state.step + 1, f"loss={loss}, grad_norm={grad_norm}", lr,
                    ckpt.latest()))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            state.tokens_seen += budget.tokens_per_step
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
                log.info(f"step {state.step}: checkpoint {save()}")
            if preempted:
                log.warning(f"preemption signal: saved step {state.step}; exiting for a requeue")
                accelerator.end_training()
                preemption.handoff()  # raises SystemExit; the with-block closes the metrics
            if stop:
                break
            t_last += time.perf_counter() - t_pause

    finished = state.step >= budget.total_steps
    export = run_dir / "hf"
    if finished and cfg.trainer.export and not (already_done and export.is_dir()):
        export_hf(accelerator, model, tokenizer, export)
        log.info(f"exported the model and tokenizer to {export}")
    accelerator.end_training()
    accelerator.free_memory()  # a multirun's next job starts from an empty device
    return {"step": state.step, "tokens_seen": state.tokens_seen, "loss": loss, "val_loss": val_loss,
            "finished": finished, "checkpoint": ckpt.latest(), "export": export if export.is_dir() else None}


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(dict_cfg: DictConfig) -> None:
    dict_cfg.run_dir = HydraConfig.get().runtime.output_dir  # == run_dir; per-job subdir under -m
    try:
        train(load_config(dict_cfg))
    except ConfigError as e:  # bad values, an impossible batch split, a missing device: one line
        print(f"config error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
