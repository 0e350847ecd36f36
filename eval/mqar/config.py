"""The MQAR benchmark's settings: a dataclass, its presets, and ``key=value`` overrides from the command line."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields
from typing import Any

from eval.mqar.data import MQARSetting
from eval.mqar.train import Budget, MixerChoice, check_curve

ALL_MIXERS = ("kdn_diag", "kdn_diag/mu=1", "kdn_diag/mu=4dk", "kdn_iso", "kda", "gdn", "deltanet", "gdn2",
              "mamba3_siso", "mamba3_mimo", "attn")
"""Every registry mixer at its defaults (Diagonal KDN's ``mu = d_k``) plus Diagonal KDN at ``mu = 1`` and ``4 d_k``."""
ZOOLOGY_SETTINGS = ("64x4", "128x8", "256x16", "512x64")
LONG_SETTINGS = ("1024x128", "2048x256")
H200_TIMES = "bench/results/mqar_h200_grid"
"""The job files of the default grid trained on one H200, whose wall times order a new grid's queue there."""


def scored_names(settings: list[str], test_settings: list[str]) -> list[str]:
    """The settings a model is scored on, in order: the trained ``settings``, then the ``test_settings`` not among
    them."""
    return [*settings, *(s for s in test_settings if s not in settings)]


@dataclass
class MQARConfig:
    """Everything a benchmark run depends on; ``preset`` fills the budget, explicit keys override it.

    The grid is ``mixers x widths x lrs x seeds``, one model per cell, each trained once on the mixture of all
    ``settings`` (Zoology's protocol) and scored on each of them and of ``test_settings`` (scored only: longer
    sequences with more pairs than any training sequence, as in Zoology's test set):
    ``min(train_examples, max_train_tokens // seq_len)`` examples per setting, in batches of
    ``batch_tokens // seq_len`` sequences, ``epochs`` passes. The learning rate is chosen per
    ``(setting, mixer, width)`` by the mean validation accuracy over seeds; the test accuracy at that rate is
    reported.

    How it runs (no effect on the results' identity): ``workers`` processes (0: 6 on CUDA, 1 on the CPU), each
    training up to ``streams`` jobs of one ``(mixer, width)`` side by side on their own CUDA streams (0: 3 on CUDA,
    1 on the CPU), their steps replayed from CUDA graphs when ``graphs``; the longest jobs start first, by the wall
    times of the jobs stored under ``out`` and, for the cells it lacks, under the folders ``times`` on the same
    device (``times=`` for none: :func:`eval.mqar.run.measured_costs`). ``curve``: what the epochs before the last
    are scored on, the training mixture's settings (``train``) or every scored one (``all``); the last epoch is
    always scored on all of them. ``train=false`` trains nothing and
    reports the jobs already stored under ``out`` (a grid cut short: the rest are listed as missing).
    """

    preset: str = "auto"
    mixers: list[str] = field(default_factory=lambda: list(ALL_MIXERS))
    widths: list[int] = field(default_factory=lambda: [64, 128, 256])
    settings: list[str] = field(default_factory=lambda: list(ZOOLOGY_SETTINGS))
    test_settings: list[str] = field(default_factory=lambda: list(LONG_SETTINGS))
    seeds: list[int] = field(default_factory=lambda: [0])
    lrs: list[float] = field(default_factory=lambda: [3e-4, 1e-3])
    train_examples: int = 100_000
    max_train_tokens: int = 4_194_304
    valid_examples: int = 1_000
    test_examples: int = 3_000
    batch_tokens: int = 32_768
    epochs: int = 8
    vocab_size: int = 8192
    power_a: float = 0.01
    head_dim: int = 64
    warmup_frac: float = 0.05
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    grad_clip: float = 1.0
    device: str = "auto"
    workers: int = 0
    streams: int = 0
    graphs: bool = True
    curve: str = "train"
    train: bool = True
    threads: int = 1
    times: list[str] = field(default_factory=lambda: [H200_TIMES])
    out: str = ""
    results: str = ""

    def setting_objects(self) -> list[MQARSetting]:
        """``settings`` (the training mixture) parsed; raises on a malformed or impossible one."""
        return [MQARSetting.parse(s, self.vocab_size, self.power_a) for s in self.settings]

    def scored_names(self) -> list[str]:
        """Every setting a model is scored on (:func:`scored_names`)."""
        return scored_names(self.settings, self.test_settings)

    def scored_settings(self) -> list[MQARSetting]:
        """:meth:`scored_names` parsed."""
        return [MQARSetting.parse(s, self.vocab_size, self.power_a) for s in self.scored_names()]

    def mixer_choices(self) -> list[MixerChoice]:
        """``mixers`` parsed (raises on an unknown mixer or option)."""
        return [MixerChoice.parse(m) for m in self.mixers]

    def budget(self) -> Budget:
        """The training budget of every model of the grid."""
        if self.batch_tokens < 1 or self.epochs < 1:
            raise ValueError(f"batch_tokens and epochs must be >= 1, got {self.batch_tokens} and {self.epochs}")
        mix = []
        for s in self.setting_objects():
            batch = max(1, self.batch_tokens // s.seq_len)
            n = min(self.train_examples, self.max_train_tokens // s.seq_len)
            mix.append((s.name, max(batch, n // batch * batch)))
        return Budget(train_mix=tuple(mix), valid_examples=self.valid_examples, test_examples=self.test_examples,
                      batch_tokens=self.batch_tokens, epochs=self.epochs, warmup_frac=self.warmup_frac,
                      min_lr_ratio=self.min_lr_ratio, weight_decay=self.weight_decay,
                      betas=(float(self.betas[0]), float(self.betas[1])), eps=self.eps, grad_clip=self.grad_clip,
                      head_dim=self.head_dim, vocab_size=self.vocab_size, power_a=self.power_a)


PRESETS: dict[str, dict[str, Any]] = {
    "full": {},
    "smoke": {"max_train_tokens": 262_144, "epochs": 1, "valid_examples": 256, "test_examples": 512},
    "cpu": {"widths": [64], "settings": ["64x4"], "test_settings": [], "train_examples": 6_400, "valid_examples": 256,
            "test_examples": 512, "batch_tokens": 2_048, "epochs": 1, "lrs": [1e-3, 3e-3, 1e-2]},
}
"""``full``: the default grid (one H200: see docs/mqar.md); ``smoke``: every mixer, width and setting with one pass
over 5 % of the tokens (a GPU check of the whole pipeline); ``cpu``: the smallest setting at width 64, for a laptop.
``auto`` is ``full`` when CUDA is available and ``cpu`` otherwise."""


def _convert(f: dataclasses.Field, text: str) -> Any:
    kind = f.default_factory().__class__ if f.default_factory is not dataclasses.MISSING else type(f.default)
    if kind is list:
        item = type(f.default_factory()[0])
        return [item(x) for x in text.split(",") if x.strip()]
    if kind is bool:
        return text.lower() in ("1", "true", "yes")
    return kind(text)


def parse_overrides(argv: list[str]) -> tuple[MQARConfig, dict[str, Any]]:
    """``["mixers=kdn_diag,kda", "widths=64", "preset=smoke"]`` -> the config (preset first, then the keys) and
    the explicit overrides. Lists are comma-separated; an unknown key raises naming the known ones."""
    known = {f.name: f for f in fields(MQARConfig)}
    explicit: dict[str, Any] = {}
    for arg in argv:
        key, sep, value = arg.lstrip("-").partition("=")
        if key == "quick" and not sep:
            key, sep, value = "preset", "=", "smoke"
        if not sep:
            raise ValueError(f"argument {arg!r} is not key=value (e.g. mixers=kdn_diag,kda widths=64)")
        if key not in known:
            raise ValueError(f"unknown key {key!r}; known keys: {', '.join(known)}")
        try:
            explicit[key] = _convert(known[key], value)
        except ValueError:
            raise ValueError(f"cannot read {key}={value!r}; expected the type of {known[key].default!r}") from None
    preset = explicit.get("preset", "auto")
    if preset == "auto":
        import torch

        preset = "full" if torch.cuda.is_available() else "cpu"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {['auto', *PRESETS]}")
    cfg = MQARConfig(**{**PRESETS[preset], **explicit, "preset": preset})
    check_curve(cfg.curve)
    cfg.budget()  # validates the settings, the budget and the mixers now, not after the first job
    cfg.scored_settings()
    cfg.mixer_choices()
    if not cfg.out:
        cfg.out = f"runs/mqar/{preset}"
    if not cfg.results:
        cfg.results = f"{cfg.out}/mqar.json"
    return cfg, explicit
