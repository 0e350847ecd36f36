"""One MQAR job: build a two-layer backbone through ``models.model_config``, train it on a mixture of settings
with the training code's AdamW and warm-up + cosine schedule, and score it on every setting's validation and test
splits.

As in Zoology, one model learns all settings at once: its batches are drawn from every setting of the mixture, each
batch from one setting (``batch_tokens / seq_len`` sequences). The loss and the accuracy count only answer
positions: the LM head runs on the hidden states of those positions only (gathered by index, so a step needs no
host synchronisation), and no ``[B, T, V]`` logits are ever materialised.

Small models leave a GPU idle, so on CUDA a job's steps are replayed from CUDA graphs (:mod:`eval.mqar.step`) on the
job's own stream, and :func:`train_together` interleaves several jobs in one process so that their kernels overlap.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

import models
from eval.mqar.data import MQARSetting, MQARSplit
from eval.mqar.step import TrainStep, answer_logits, autocast
from models.registry import KDN_MIXERS
from trainer.optim import build_optimizer, build_scheduler

STRING_KWARGS = ("mu", "noise", "alpha_param", "memory", "backend")
"""Mixer options kept as strings when parsed from ``name/key=value`` (``mu=1`` is the choice ``"1"``)."""
CHECK_EVERY = 50
"""Steps between checks that the loss is finite (a divergence stops the job within this many steps)."""
CURVES = ("train", "all")
"""What an epoch before the last is scored on: the training mixture's settings, or every scored one."""
PRECISIONS = ("bf16", "fp32")
"""The KDN mixers' memory precision on CUDA (their ``precision`` mixer option); ``bf16`` is the default path."""
PRECISION_MIXERS = KDN_MIXERS
"""The mixers that take ``precision``; for the others it does not apply (recorded as ``None``)."""
DEFAULT_INIT, DEFAULT_PRECISION = "fla", "bf16"


def arm_suffix(init: str, precision: str | None) -> str:
    """What a job's or a results file's name adds for a non-default ``init`` or ``precision``: ``""`` at the
    defaults (the names every earlier grid has), e.g. ``"_init-authors_fp32"``."""
    return (("" if init == DEFAULT_INIT else f"_init-{init}")
            + ("" if precision in (None, DEFAULT_PRECISION) else f"_{precision}"))


def job_precision(mixer: str, precision: str) -> str | None:
    """``precision`` for a mixer that takes it (:data:`PRECISION_MIXERS`), ``None`` (not applicable) otherwise."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not one of {list(PRECISIONS)}")
    return precision if mixer in PRECISION_MIXERS else None


def check_curve(curve: str) -> None:
    """Raise on a ``curve`` that is not one of :data:`CURVES`."""
    if curve not in CURVES:
        raise ValueError(f"curve={curve!r} is not one of {list(CURVES)}")


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


def model_config(choice: MixerChoice, width: int, head_dim: int, vocab_size: int, init: str = "fla",
                 precision: str | None = None) -> models.KDNConfig:
    """The two-layer backbone of ``choice`` at hidden size ``width``: ``width / head_dim`` heads of ``head_dim``
    (attention: full, no window), SwiGLU width solved to KDA's parameter count as in every comparison here;
    ``init``: the weight initialisation rule (``KDNConfig.init``); ``precision``: the KDN mixers' memory precision,
    their ``precision`` mixer option unless ``choice`` sets it (``None`` for a mixer that does not take it,
    :func:`job_precision`); at the default, ``bf16``, the option is left out, so the model's identity is unchanged.

    The recurrent state per layer is then ``heads x head_dim^2`` for the matrix-state mixers (plus ``heads x
    head_dim`` or ``heads`` precisions for Diagonal/Isotropic KDN), and Mamba-3's ``d_state`` is solved by the
    registry so that ``expand x width x d_state`` equals the same ``heads x head_dim^2``. Mamba-3's heads are
    ``head_dim`` wide too (``expand x width / head_dim`` of them), not the registry's 16 at its ``toy`` size, which
    mamba-ssm's MIMO kernels do not compile for (they are tested at 32, 64 and 128)."""
    if width % head_dim:
        raise ValueError(f"width {width} is not a multiple of head_dim {head_dim}; pick widths that are")
    kwargs = dict(choice.kwargs)
    if choice.name.startswith("mamba3"):
        kwargs.setdefault("head_dim", head_dim)
    if precision not in (None, DEFAULT_PRECISION):
        kwargs.setdefault("precision", precision)
    return models.model_config("toy", choice.name, vocab_size=vocab_size, hidden_size=width, num_layers=2,
                               num_heads=width // head_dim, head_dim=head_dim, mixer_kwargs=kwargs, init=init,
                               window=None)  # attention here is full


def architecture(choice: MixerChoice, width: int, head_dim: int, vocab_size: int) -> dict[str, Any]:
    """What identifies the model of :func:`model_config`: its mixer options as resolved there, its parameter count
    and a SHA-256 of every parameter's name and shape (the model built on the meta device: nothing is allocated).
    Every mixer's SwiGLU width is solved to KDA's count, so the count alone barely tells two layouts apart."""
    cfg = model_config(choice, width, head_dim, vocab_size)
    with torch.device("meta"):
        named = list(models.build_model(cfg).named_parameters())
    shapes = ";".join(f"{name}:{tuple(p.shape)}" for name, p in named)
    # attention's window is recorded among its options, as the results written before it was the backbone's have it
    kwargs = {**cfg.mixer_kwargs, "window": cfg.window} if cfg.mixer == "attn" else dict(cfg.mixer_kwargs)
    return {"mixer_kwargs": kwargs, "params": sum(p.numel() for _, p in named),
            "shapes_sha256": hashlib.sha256(shapes.encode()).hexdigest()}


def state_elements(cfg: models.KDNConfig, seq_len: int) -> tuple[int, bool]:
    """``(elements, recurrent)``: the recurrent state per sequence summed over layers, or for full attention its
    key-value cache after ``seq_len`` tokens (``recurrent`` False: it grows with the sequence)."""
    size = models.recurrent_state_size(cfg)
    if size is not None:
        return size, True
    return 2 * seq_len * cfg.num_heads * cfg.head_dim * cfg.num_layers, False


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


@dataclass(frozen=True)
class ExampleBudget:
    """What one job trains on, counted in examples per setting, and how (the optimiser's settings are
    conf/optim/adamw.yaml's, but for ``lr``).

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


def epoch_batches(splits: list[MQARSplit], epoch: int, seed: int) -> list[tuple[int, int]]:
    """One pass over every split: ``(split index, batch number)`` in an order drawn from ``(seed, epoch)``; batch
    ``j`` of split ``i`` is ``splits[i].order(epoch)[j * batch:(j + 1) * batch]``."""
    batches = [(i, j) for i, split in enumerate(splits) for j in range(len(split))]
    g = torch.Generator().manual_seed(seed * 7_919 + epoch)
    return [batches[j] for j in torch.randperm(len(batches), generator=g).tolist()]


class JobRun:
    """One model's training and scoring, as a generator of steps (:meth:`steps`) that :func:`train_together`
    interleaves with other jobs'. On CUDA every job has its own stream, so the kernels of several small models run
    side by side on one GPU, and its steps are replayed from CUDA graphs (``graphs``, :class:`TrainStep`).

    With ``checkpoint``, the job's whole state (model, optimiser, schedule, curve, the loss window) is written there
    after every epoch but the last (temp file, then ``os.replace``), and a job built on a checkpoint of the same
    ``identity`` starts at the epoch after it: a grid stopped by a time limit loses at most one epoch per job. The
    epoch orders depend only on ``(seed, epoch)``, so on the CPU a resumed job ends exactly as an uninterrupted one.

    Args: as :func:`train_job`, and ``checkpoint`` (a file path, or ``None``: no checkpoints), ``identity`` (a
    JSON-able description of the job; a checkpoint of another identity is ignored and overwritten), ``curve``
    (:data:`CURVES`), ``init`` and ``precision`` (:func:`model_config`).
    """

    def __init__(self, choice: MixerChoice, width: int, lr: float, seed: int, budget: ExampleBudget,
                 settings: list[MQARSetting], device: torch.device,
                 progress: Callable[[dict[str, Any]], None] | None = None, graphs: bool = True,
                 checkpoint: Path | None = None, identity: dict[str, Any] | None = None, curve: str = "all",
                 init: str = "fla", precision: str | None = None) -> None:
        check_curve(curve)
        self.init, self.precision = init, precision
        self.t0 = time.perf_counter()
        self.choice, self.width, self.lr, self.seed, self.budget = choice, width, lr, seed, budget
        self.device, self.progress = device, progress
        self.checkpoint, self.identity = checkpoint, json.loads(json.dumps(identity or {}))
        saved = self._load_checkpoint()
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        with self.on_stream():
            torch.manual_seed(seed)
            self.cfg = model_config(choice, width, budget.head_dim, budget.vocab_size, init, precision)
            self.model = models.build_model(self.cfg).to(device)
            if saved is not None:
                self.model.load_state_dict(saved["model"])
            self.train = [MQARSplit(s, "train", n, budget.batch_size(s), seed=seed) for s, n in budget.mixture()]
            self.valid = [MQARSplit(s, "valid", budget.valid_examples, budget.batch_size(s)) for s in settings]
            # the last epoch's validation, which picks the learning rate, covers every scored setting; with
            # curve="train" the earlier ones cover the training mixture's only: the scored-only settings are the
            # longest (three quarters of the default validation tokens), and a curve point changes no training
            trained = {s.name for s, _ in budget.mixture()}
            self.curve_valid = [v for v in self.valid if curve == "all" or v.setting.name in trained]
            for split in (*self.train, *self.valid):
                split.tensors(device)
            self.total = budget.epochs * budget.steps_per_epoch()
            optimizer = build_optimizer(self.model, lr=lr, betas=budget.betas, weight_decay=budget.weight_decay,
                                        eps=budget.eps)
            self.scheduler = build_scheduler(optimizer, warmup_steps=max(1, round(budget.warmup_frac * self.total)),
                                             total_steps=self.total, min_ratio=budget.min_lr_ratio)
            if saved is not None:  # before TrainStep, which makes each group's restored learning rate a tensor
                optimizer.load_state_dict(saved["optimizer"])
                self.scheduler.load_state_dict(saved["scheduler"])
            self.step = TrainStep(self.model, optimizer, budget.grad_clip, device, graphs)
        self.steps_done, self.diverged, self.final_loss, self.curve = 0, False, math.nan, []
        self.start_epoch, self.before_s, self.resumed_from, self._window = 0, 0.0, [], []
        if saved is not None:
            self.steps_done, self.final_loss, self.curve = saved["steps_done"], saved["final_loss"], saved["curve"]
            self.start_epoch, self.before_s = saved["epoch"], saved["elapsed_s"]
            self.resumed_from = [*saved["resumed_from"], saved["epoch"]]
            self._window = [(loss.to(device), norm.to(device)) for loss, norm in saved["window"]]
        self.train_s = 0.0

    def elapsed(self) -> float:
        """Seconds this job has run, over every process that ran a part of it."""
        return self.before_s + time.perf_counter() - self.t0

    def _load_checkpoint(self) -> dict[str, Any] | None:
        """The stored state of this job, or ``None`` when there is none, it is unreadable or of another identity."""
        if self.checkpoint is None or not self.checkpoint.exists():
            return None
        try:
            saved = torch.load(self.checkpoint, map_location=self.device, weights_only=True)
        except Exception:  # noqa: BLE001 - a torn or foreign file: train from the start and overwrite it
            return None
        return saved if saved.get("identity") == self.identity else None

    def _save_checkpoint(self, epochs_done: int, window: list[tuple[Tensor, Tensor]]) -> None:
        """The whole state after ``epochs_done`` epochs, written atomically to ``checkpoint``."""
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        state = {"identity": self.identity, "epoch": epochs_done, "steps_done": self.steps_done,
                 "final_loss": self.final_loss, "curve": self.curve, "elapsed_s": self.elapsed(),
                 "resumed_from": self.resumed_from, "window": [(loss.cpu(), norm.cpu()) for loss, norm in window],
                 "model": self.model.state_dict(), "optimizer": self.step.optimizer.state_dict(),
                 "scheduler": self.scheduler.state_dict()}
        tmp = self.checkpoint.with_name(self.checkpoint.name + ".tmp")
        torch.save(state, tmp)
        os.replace(tmp, self.checkpoint)

    def on_stream(self) -> contextlib.AbstractContextManager:
        """The job's CUDA stream as the current one (nothing off CUDA)."""
        return torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()

    def steps(self) -> Iterator[None]:
        """Train, yielding after each queued step and each epoch's validation; then score the test splits."""
        window = self._window
        for epoch in range(self.start_epoch, self.budget.epochs):
            with self.on_stream():  # each split's order for the epoch, on the device once, cut into its batches
                batches = [split.order(epoch).to(self.device).split(split.batch) for split in self.train]
            for i, j in epoch_batches(self.train, epoch, self.seed):
                with self.on_stream():
                    window.append(self.step(*self.train[i].take(batches[i][j], self.device)))
                    self.scheduler.step()
                    self.steps_done += 1
                    if len(window) == CHECK_EVERY or self.steps_done == self.total:  # one host sync per window
                        losses, norms = (torch.stack(x) for x in zip(*window))
                        self.diverged = not bool(torch.isfinite(losses).all() & torch.isfinite(norms).all())
                        self.final_loss, window = float(losses.mean()), []
                if self.diverged:
                    break
                yield
            last = epoch + 1 == self.budget.epochs or self.diverged
            with self.on_stream():
                valid = {v.setting.name: accuracy(self.model, v, self.device)
                         for v in (self.valid if last else self.curve_valid)}
                self.curve.append({"epoch": epoch + 1, "step": self.steps_done, "s": round(self.elapsed(), 2),
                                   "loss": self.final_loss, "valid": valid})
                if self.checkpoint is not None and not self.diverged and epoch + 1 < self.budget.epochs:
                    self._save_checkpoint(epoch + 1, window)
            if self.progress is not None:
                self.progress(self.curve[-1])
            yield
            if self.diverged:
                break
        self.train_s = self.elapsed()
        with self.on_stream():
            self.records = []
            for v in self.valid:
                test = MQARSplit(v.setting, "test", self.budget.test_examples, v.batch)
                state, recurrent = state_elements(self.cfg, v.setting.seq_len)
                self.records.append({"setting": v.setting.name, "valid_acc": self.curve[-1]["valid"][v.setting.name],
                                     "test_acc": accuracy(self.model, test, self.device), "state": state,
                                     "state_recurrent": recurrent})

    def result(self) -> dict[str, Any]:
        """The JSON-able record of a finished job (see :func:`train_job`)."""
        return {
            "mixer": self.choice.label, "width": self.width, "lr": self.lr, "seed": self.seed,
            "init": self.init, "precision": self.precision,
            "records": self.records, "curve": self.curve, "final_loss": self.final_loss, "diverged": self.diverged,
            "steps": self.steps_done, "total_steps": self.total,
            "tokens": self.budget.tokens() * self.steps_done // max(1, self.total), "num_heads": self.cfg.num_heads,
            "head_dim": self.cfg.head_dim, "params": sum(p.numel() for p in self.model.parameters()),
            "cuda_graphs": self.step.graphs, "graph_fallback": self.step.fallback, "train_s": self.train_s,
            "wall_s": self.elapsed(), "resumed_from": self.resumed_from,
        }


def train_together(runs: list[JobRun]) -> list[dict[str, Any] | BaseException]:
    """Step ``runs`` in turn, one queued step each, until all are done. The host queues work on every job's stream
    while the GPU runs the others', so no job waits on another's host time.

    Returns each run's :meth:`JobRun.result`, in order, or the exception that stopped it (the others go on)."""
    if any(r.stream is not None for r in runs):
        torch.cuda.synchronize()  # every job's model and splits are on the device before any stream reads them
    out: list[dict[str, Any] | BaseException | None] = [None] * len(runs)
    active = [(k, iter(r.steps())) for k, r in enumerate(runs)]
    while active:
        still = []
        for k, it in active:
            try:
                next(it)
                still.append((k, it))
            except StopIteration:
                out[k] = runs[k].result()
            except Exception as err:  # noqa: BLE001 - one broken job must not stop the others
                out[k] = err
        active = still
    return out  # type: ignore[return-value]


def train_job(choice: MixerChoice, width: int, lr: float, seed: int, budget: ExampleBudget,
              settings: list[MQARSetting], device: torch.device,
              progress: Callable[[dict[str, Any]], None] | None = None, graphs: bool = True,
              curve: str = "all", init: str = "fla", precision: str | None = None) -> dict[str, Any]:
    """Train one model on ``budget``'s mixture and score it on each of ``settings``; ``progress`` is called with
    each point of the curve as it is measured; ``graphs``: replay the steps from CUDA graphs on CUDA; ``curve``:
    ``"train"`` scores the epochs before the last on the training mixture's settings only (:data:`CURVES`);
    ``init`` and ``precision``: :func:`model_config`'s.

    Returns a JSON-able record: ``records`` (one per setting: validation and test accuracy, state size), ``curve``
    (validation accuracy per setting after every epoch), the mean loss of the last steps, steps, parameters,
    whether CUDA graphs ran the steps (``cuda_graphs``; ``graph_fallback``: why not, when a capture failed), wall
    time, and ``diverged`` (a non-finite loss or gradient stops training; the model is scored as it stands)."""
    result = train_together([JobRun(choice, width, lr, seed, budget, settings, device, progress, graphs,
                                    curve=curve, init=init, precision=precision)])[0]
    if isinstance(result, BaseException):
        raise result
    return result
