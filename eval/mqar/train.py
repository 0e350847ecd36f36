"""One MQAR job: build a two-layer backbone through ``models.model_config``, train it on one setting with the
training code's AdamW and warm-up + cosine schedule, and score it on the validation and test splits.

The loss and the accuracy count only answer positions (labels other than ``-100``): the LM head runs on the hidden
states of those positions only, so no ``[B, T, V]`` logits are ever materialised.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import models
from eval.mqar.data import IGNORE, MQARSetting, MQARSplit
from trainer.optim import build_optimizer, build_scheduler

STRING_KWARGS = ("mu", "noise", "alpha_param", "memory", "backend")
"""Mixer options kept as strings when parsed from ``name/key=value`` (``mu=1`` is the choice ``"1"``)."""
CHECK_EVERY = 50
"""Steps between checks that the loss is finite (a divergence stops the job within this many steps)."""


@dataclass(frozen=True)
class MixerChoice:
    """A registry mixer and its options, written ``name`` or ``name/key=value/...`` (e.g. ``kdn_diag/mu=4dk``)."""

    name: str
    kwargs: tuple[tuple[str, Any], ...] = ()

    @classmethod
    def parse(cls, text: str) -> MixerChoice:
        """``"kdn_diag/mu=1"`` -> ``MixerChoice("kdn_diag", (("mu", "1"),))``; unknown mixers and options raise."""
        import yaml

        name, *opts = text.strip().split("/")
        spec = models.MIXERS[name]
        kwargs = []
        for opt in opts:
            key, sep, value = opt.partition("=")
            if not sep:
                raise ValueError(f"mixer option {opt!r} of {text!r} is not key=value (e.g. kdn_diag/mu=4dk)")
            if key not in spec.kwargs:
                raise ValueError(f"mixer {name!r} does not take {key!r}; its options are {list(spec.kwargs)}")
            kwargs.append((key, value if key in STRING_KWARGS else yaml.safe_load(value)))
        return cls(name, tuple(kwargs))

    @property
    def label(self) -> str:
        """The written form, ``name/key=value/...``."""
        return "/".join([self.name, *(f"{k}={'None' if v is None else v}" for k, v in self.kwargs)])


def model_config(choice: MixerChoice, width: int, head_dim: int, vocab_size: int) -> models.KDNConfig:
    """The two-layer backbone of ``choice`` at hidden size ``width``: ``width / head_dim`` heads of ``head_dim``
    (attention: full, no window), SwiGLU width solved to KDA's parameter count as in every comparison here.

    The recurrent state per layer is then ``heads x head_dim^2`` for the matrix-state mixers (plus ``heads x
    head_dim`` or ``heads`` precisions for Diagonal/Isotropic KDN), and Mamba-3's ``d_state`` is solved by the
    registry so that ``expand x width x d_state`` equals the same ``heads x head_dim^2``."""
    if width % head_dim:
        raise ValueError(f"width {width} is not a multiple of head_dim {head_dim}; pick widths that are")
    kwargs = dict(choice.kwargs)
    if choice.name == "attn":
        kwargs.setdefault("window", None)
    return models.model_config("toy", choice.name, vocab_size=vocab_size, hidden_size=width, num_layers=2,
                               num_heads=width // head_dim, head_dim=head_dim, mixer_kwargs=kwargs)


def state_elements(cfg: models.KDNConfig, seq_len: int) -> tuple[int, bool]:
    """``(elements, recurrent)``: the recurrent state per sequence summed over layers, or for full attention its
    key-value cache after ``seq_len`` tokens (``recurrent`` False: it grows with the sequence)."""
    size = models.recurrent_state_size(cfg)
    if size is not None:
        return size, True
    return 2 * seq_len * cfg.num_heads * cfg.head_dim * cfg.num_layers, False


def answer_logits(model: torch.nn.Module, inputs: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """Logits at the answer positions only. ``inputs, labels [B, T]`` -> ``logits [N, V]``, ``target [N]`` for the
    ``N`` labels other than ``-100``."""
    hidden, _, _ = model.model(inputs)
    mask = labels != IGNORE
    return model.lm_head(hidden[mask]), labels[mask]


def answer_metrics(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, int]:
    """Cross-entropy and hits over answer positions. ``logits [..., V]`` with ``labels [...]`` (``-100``: not an
    answer, ignored). Returns ``(mean loss, hits, answers)``."""
    mask = labels != IGNORE
    logits, target = logits[mask].float(), labels[mask]
    loss = F.cross_entropy(logits, target)
    return loss, (logits.argmax(-1) == target).sum(), int(target.numel())


@torch.no_grad()
def accuracy(model: torch.nn.Module, split: MQARSplit, device: torch.device) -> float:
    """Fraction of answer positions of ``split`` whose argmax is the value."""
    model.eval()
    hits, total = torch.zeros((), dtype=torch.int64, device=device), 0
    for inputs, labels in split.batches():
        with autocast(device):
            logits, target = answer_logits(model, inputs.to(device), labels.to(device))
        _, h, n = answer_metrics(logits, target)
        hits += h
        total += n
    model.train()
    return hits.item() / total


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (as in training), FP32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Budget:
    """What one job trains on and how (the optimiser's settings are conf/optim/adamw.yaml's, but for ``lr``)."""

    train_examples: int
    valid_examples: int
    test_examples: int
    batch_size: int
    epochs: int
    warmup_frac: float
    min_lr_ratio: float
    weight_decay: float
    betas: tuple[float, float]
    eps: float
    grad_clip: float
    head_dim: int
    vocab_size: int
    power_a: float


def train_job(choice: MixerChoice, width: int, setting: MQARSetting, lr: float, seed: int, budget: Budget,
              device: torch.device) -> dict[str, Any]:
    """Train and score one model. Returns a JSON-able record: accuracies, final loss, state size, parameters, steps,
    wall time, and ``diverged`` (a non-finite loss stops training; the model is scored as it stands)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    cfg = model_config(choice, width, budget.head_dim, budget.vocab_size)
    model = models.build_model(cfg).to(device)
    train = MQARSplit(setting, "train", budget.train_examples, budget.batch_size, seed=seed)
    valid = MQARSplit(setting, "valid", budget.valid_examples, budget.batch_size)
    test = MQARSplit(setting, "test", budget.test_examples, budget.batch_size)
    total = budget.epochs * len(train)
    optimizer = build_optimizer(model, lr=lr, betas=budget.betas, weight_decay=budget.weight_decay, eps=budget.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=max(1, round(budget.warmup_frac * total)),
                                total_steps=total, min_ratio=budget.min_lr_ratio)
    step, diverged, final_loss, window = 0, False, math.nan, []
    model.train()
    batches = (b for epoch in range(budget.epochs) for b in train.batches(epoch, shuffle=True))
    for inputs, labels in batches:
        with autocast(device):
            logits, target = answer_logits(model, inputs.to(device, non_blocking=True),
                                           labels.to(device, non_blocking=True))
        loss = F.cross_entropy(logits.float(), target)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), budget.grad_clip)
        window.append(loss.detach())
        if len(window) == CHECK_EVERY or step + 1 == total:  # one host sync per CHECK_EVERY steps
            recent = torch.stack(window)
            diverged = not bool(torch.isfinite(recent).all() and torch.isfinite(grad_norm))
            final_loss, window = float(recent[-1]), []
            if diverged:
                break
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
    train_s = time.perf_counter() - t0
    valid_acc, test_acc = accuracy(model, valid, device), accuracy(model, test, device)
    state, recurrent = state_elements(cfg, setting.seq_len)
    return {
        "setting": setting.name, "mixer": choice.label, "width": width, "lr": lr, "seed": seed,
        "valid_acc": valid_acc, "test_acc": test_acc, "final_loss": final_loss, "diverged": diverged,
        "steps": step, "total_steps": total, "state": state, "state_recurrent": recurrent,
        "num_heads": cfg.num_heads, "head_dim": cfg.head_dim,
        "params": sum(p.numel() for p in model.parameters()),
        "train_s": train_s, "wall_s": time.perf_counter() - t0,
    }
