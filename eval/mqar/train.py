"""One MQAR job: build a two-layer backbone through ``models.model_config``, train it on a mixture of settings
with the training code's AdamW and warm-up + cosine schedule, and score it on every setting's validation and test
splits.

As in Zoology, one model learns all settings at once: its batches are drawn from every setting of the mixture, each
batch from one setting (``batch_tokens / seq_len`` sequences). The loss and the accuracy count only answer
positions: the LM head runs on the hidden states of those positions only (gathered by index, so a step needs no
host synchronisation), and no ``[B, T, V]`` logits are ever materialised.
"""
from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import models
from eval.mqar.data import MQARSetting, MQARSplit
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


def answer_logits(model: torch.nn.Module, inputs: Tensor, positions: Tensor) -> Tensor:
    """Logits at the answer positions only. ``inputs [B, T]``, ``positions [B, P]`` -> ``logits [B * P, V]``."""
    hidden, _, _ = model.model(inputs)
    picked = hidden.gather(1, positions[..., None].expand(-1, -1, hidden.shape[-1]))
    return model.lm_head(picked.flatten(0, 1))


@torch.no_grad()
def accuracy(model: torch.nn.Module, split: MQARSplit, device: torch.device) -> float:
    """Fraction of the answer positions of ``split`` whose argmax is the value."""
    model.eval()
    hits = torch.zeros((), dtype=torch.int64, device=device)
    for inputs, positions, values in split.batches(device):
        with autocast(device):
            logits = answer_logits(model, inputs, positions)
        hits += (logits.argmax(-1) == values.flatten()).sum()
    model.train()
    return hits.item() / (split.n * split.setting.pairs)


def autocast(device: torch.device) -> contextlib.AbstractContextManager:
    """bf16 autocast on CUDA (as in training), FP32 elsewhere."""
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@dataclass(frozen=True)
class Budget:
    """What one job trains on and how (the optimiser's settings are conf/optim/adamw.yaml's, but for ``lr``).

    ``train_mix``: ``(setting, examples)`` pairs, every one a multiple of its batch, ``batch_tokens // seq_len``
    sequences (at least 1)."""

    train_mix: tuple[tuple[str, int], ...]
    valid_examples: int
    test_examples: int
    batch_tokens: int
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

    def batch_size(self, setting: MQARSetting) -> int:
        """Sequences per batch of ``setting``: ``batch_tokens // seq_len``, at least 1."""
        return max(1, self.batch_tokens // setting.seq_len)

    def mixture(self) -> list[tuple[MQARSetting, int]]:
        """``train_mix`` parsed: ``[(setting, examples)]``."""
        return [(MQARSetting.parse(name, self.vocab_size, self.power_a), n) for name, n in self.train_mix]

    def steps_per_epoch(self) -> int:
        """Optimiser steps of one pass over the mixture (a last partial batch is a step too)."""
        return sum(-(-n // self.batch_size(s)) for s, n in self.mixture())

    def tokens(self) -> int:
        """Training tokens of a job (every pass)."""
        return self.epochs * sum(n * s.seq_len for s, n in self.mixture())


def epoch_batches(splits: list[MQARSplit], epoch: int, seed: int) -> list[tuple[int, Tensor]]:
    """One pass over every split: ``(split index, example indices [batch])`` in an order drawn from ``(seed,
    epoch)``, the examples of each split in that split's own order for the epoch."""
    batches = [(i, chunk) for i, split in enumerate(splits) for chunk in split.order(epoch).split(split.batch)]
    g = torch.Generator().manual_seed(seed * 7_919 + epoch)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


def train_job(choice: MixerChoice, width: int, lr: float, seed: int, budget: Budget,
              settings: list[MQARSetting], device: torch.device,
              progress: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Train one model on ``budget``'s mixture and score it on each of ``settings``; ``progress`` is called with
    each point of the curve as it is measured.

    Returns a JSON-able record: ``records`` (one per setting: validation and test accuracy, state size), ``curve``
    (validation accuracy per setting after every epoch), the mean loss of the last steps, steps, parameters, wall
    time, and ``diverged`` (a non-finite loss stops training; the model is scored as it stands)."""
    t0 = time.perf_counter()
    torch.manual_seed(seed)
    cfg = model_config(choice, width, budget.head_dim, budget.vocab_size)
    model = models.build_model(cfg).to(device)
    train = [MQARSplit(s, "train", n, budget.batch_size(s), seed=seed) for s, n in budget.mixture()]
    valid = [MQARSplit(s, "valid", budget.valid_examples, budget.batch_size(s)) for s in settings]
    total = budget.epochs * budget.steps_per_epoch()
    optimizer = build_optimizer(model, lr=lr, betas=budget.betas, weight_decay=budget.weight_decay, eps=budget.eps)
    scheduler = build_scheduler(optimizer, warmup_steps=max(1, round(budget.warmup_frac * total)),
                                total_steps=total, min_ratio=budget.min_lr_ratio)
    step, diverged, final_loss, window, curve = 0, False, math.nan, [], []
    model.train()
    for epoch in range(budget.epochs):
        for i, idx in epoch_batches(train, epoch, seed):
            inputs, positions, values = train[i].take(idx, device)
            with autocast(device):
                logits = answer_logits(model, inputs, positions)
            loss = F.cross_entropy(logits.float(), values.flatten())
            loss.backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), budget.grad_clip)
            window.append(loss.detach())
            if len(window) == CHECK_EVERY or step + 1 == total:  # one host sync per CHECK_EVERY steps
                recent = torch.stack(window)
                diverged = not bool(torch.isfinite(recent).all() and torch.isfinite(grad_norm))
                final_loss, window = float(recent.mean()), []
                if diverged:
                    break
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        curve.append({"epoch": epoch + 1, "step": step, "s": round(time.perf_counter() - t0, 2),
                      "loss": final_loss, "valid": {v.setting.name: accuracy(model, v, device) for v in valid}})
        if progress is not None:
            progress(curve[-1])
        if diverged:
            break
    train_s = time.perf_counter() - t0
    records = []
    for v in valid:
        test = MQARSplit(v.setting, "test", budget.test_examples, v.batch)
        state, recurrent = state_elements(cfg, v.setting.seq_len)
        records.append({"setting": v.setting.name, "valid_acc": curve[-1]["valid"][v.setting.name],
                        "test_acc": accuracy(model, test, device), "state": state, "state_recurrent": recurrent})
    return {
        "mixer": choice.label, "width": width, "lr": lr, "seed": seed, "records": records, "curve": curve,
        "final_loss": final_loss, "diverged": diverged, "steps": step, "total_steps": total,
        "tokens": budget.tokens() * step // max(1, total), "num_heads": cfg.num_heads, "head_dim": cfg.head_dim,
        "params": sum(p.numel() for p in model.parameters()), "train_s": train_s,
        "wall_s": time.perf_counter() - t0,
    }
