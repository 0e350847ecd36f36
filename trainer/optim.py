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
