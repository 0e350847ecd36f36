"""AdamW with the paper's decay rules and the warm-up + cosine schedule (docs/protocol.md §8)."""
from __future__ import annotations

import math
from functools import partial

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR


def param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed matrices, and everything else without decay.

    No decay for 1-D parameters (norms, biases, per-head/per-channel scalars) and for any parameter
    flagged ``param._no_weight_decay = True`` by the model (gate and noise scalars: ``A_log``,
    ``dt_bias``, the initial precision). Tied parameters appear once.
    """
    decay, no_decay = [], []
    for p in model.parameters():
        if not p.requires_grad:
            continue
        if p.ndim < 2 or getattr(p, "_no_weight_decay", False):
            no_decay.append(p)
        else:
            decay.append(p)
    if not decay:
        raise ValueError("the model has no 2-D trainable parameter to decay; is it built?")
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(
    model: nn.Module, *, lr: float, betas: tuple[float, float], weight_decay: float, eps: float
) -> torch.optim.AdamW:
    """AdamW over ``param_groups(model, weight_decay)``, fused: one kernel per step for all parameters (CPU and
    CUDA; foreach AdamW took 21 ms of a 750M step on an H200 against 8 ms fused, docs/performance.md, "Optimiser")."""
    return torch.optim.AdamW(param_groups(model, weight_decay), lr=lr, betas=betas, eps=eps, fused=True)


def warmup_cosine(step: int, *, warmup_steps: int, total_steps: int, min_ratio: float) -> float:
    """LR multiplier for optimiser step ``step`` (0-based): linear warm-up to 1 over ``warmup_steps``,
    then cosine from 1 down to ``min_ratio`` at ``total_steps``; ``min_ratio`` afterwards."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, min_ratio: float
) -> LambdaLR:
    """``LambdaLR`` over ``warmup_cosine``; its ``state_dict()`` is JSON-able (the lambda is a partial)."""
    fn = partial(warmup_cosine, warmup_steps=warmup_steps, total_steps=total_steps, min_ratio=min_ratio)
    return LambdaLR(optimizer, fn)


def adopt_hyperparameters(optimizer: torch.optim.Optimizer, scheduler: LambdaLR, *, lr: float,
                          betas: tuple[float, float], weight_decay: float, eps: float) -> None:
    """After loading a checkpoint (``resume=force``): replace the restored peak LR, betas, eps and weight decay
    (the decayed group of ``param_groups`` takes ``weight_decay``, the other 0) by the given ones."""
    for group, decay in zip(optimizer.param_groups, (weight_decay, 0.0)):
        group.update(initial_lr=lr, betas=betas, eps=eps, weight_decay=decay)
    scheduler.base_lrs = [lr] * len(optimizer.param_groups)
    sync_lr(optimizer, scheduler)


def sync_lr(optimizer: torch.optim.Optimizer, scheduler: LambdaLR) -> None:
    """Set each group's LR from the scheduler's current step, peak LR and lambda (as ``scheduler.step()`` does), so
    that a schedule rebuilt for a resume (another step count, ``resume=force``) applies from its first step."""
    for group, base, fn in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
        group["lr"] = base * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]  # what get_last_lr() returns


def all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """0-d bool tensor: whether every element of ``tensors`` is finite. One fused max-abs reduction per dtype and
    device (``torch._foreach_norm`` with ord inf: NaN and Inf propagate, finite values cannot overflow), no sync.
    Sharded (DTensor) parameters are checked on their local shard."""
    local = [t.to_local() if hasattr(t, "to_local") else t for t in tensors]
    local = [t.detach() for t in local if t.numel()]
    if not local:
        return torch.ones((), dtype=torch.bool)
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for norm in torch._foreach_norm(local, float("inf")):
        groups.setdefault((norm.dtype, norm.device), []).append(norm)
    device = local[0].device
    return torch.stack([torch.stack(g).isfinite().all().to(device) for g in groups.values()]).all()
