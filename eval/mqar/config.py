"""The MQAR benchmark's settings: a dataclass, its presets, and ``key=value`` overrides from the command line."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

import models
from common.options import parse_options
from eval.mqar.data import MQARSetting
from eval.mqar.train import PRECISIONS, ExampleBudget, MixerChoice, arm_suffix, check_curve, job_precision, model_config
from models.configuration import INIT_RULES

ALL_MIXERS = ("kdn_diag", "kdn_diag/mu=1", "kdn_diag/mu=4dk", "kdn_iso", "kda", "gdn", "deltanet", "gdn2",
              "mamba3_siso", "mamba3_mimo", "attn")
"""Every registry mixer at its defaults (Diagonal KDN's ``mu = d_k``) plus Diagonal KDN at ``mu = 1`` and ``4 d_k``."""
ZOOLOGY_SETTINGS = ("64x4", "128x8", "256x16", "512x64")
LONG_SETTINGS = ("1024x128", "2048x256")
H200_TIMES = "bench/results/mqar_h200_grid"
"""The default grid's jobs trained on one H200 (its job summary), whose wall times order a new queue there."""


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

    The model: ``init``, the weight initialisation rule of every model (``KDNConfig.init``: ``fla`` or
    ``authors``); ``precision``, the KDN mixers' memory precision on CUDA (their ``precision`` option: ``bf16`` or
    ``fp32``; a mixer written ``kdn_diag/precision=fp32`` keeps its own), recorded as not applicable (``None``) for
    the other mixers. Both are part of each job's identity and
    of its name where not the default, so the arms of an experiment can share ``out``; ``results`` defaults to
    ``out/mqar<arm>.json`` (e.g. ``mqar_init-authors_fp32.json``; ``mqar.json`` at the defaults).
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
    init: str = "fla"
    precision: str = "bf16"

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

    def budget(self) -> ExampleBudget:
        """The training budget of every model of the grid."""
        if self.batch_tokens < 1 or self.epochs < 1:
            raise ValueError(f"batch_tokens and epochs must be >= 1, got {self.batch_tokens} and {self.epochs}")
        mix = []
        for s in self.setting_objects():
            batch = max(1, self.batch_tokens // s.seq_len)
            n = min(self.train_examples, self.max_train_tokens // s.seq_len)
            mix.append((s.name, max(batch, n // batch * batch)))
        return ExampleBudget(train_mix=tuple(mix), valid_examples=self.valid_examples, test_examples=self.test_examples,
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


def _positive(x: Any) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


RULES: dict[str, tuple[Any, str]] = {
    "mixers": (lambda v: bool(v), "a non-empty comma-separated list of mixers (e.g. mixers=kdn_diag,kda)"),
    "widths": (lambda v: bool(v) and all(x > 0 for x in v), "a non-empty list of positive int (e.g. widths=64,128)"),
    "settings": (lambda v: bool(v), "a non-empty list of SEQLENxPAIRS settings (e.g. settings=64x4,128x8)"),
    "seeds": (lambda v: bool(v) and all(x >= 0 for x in v), "a non-empty list of int >= 0 (e.g. seeds=0,1,2)"),
    "lrs": (lambda v: bool(v) and all(_positive(x) for x in v), "a non-empty list of positive finite float "
                                                                 "(e.g. lrs=3e-4,1e-3)"),
    "train_examples": (lambda v: v >= 1, "an int >= 1"),
    "max_train_tokens": (lambda v: v >= 1, "an int >= 1"),
    "valid_examples": (lambda v: v >= 1, "an int >= 1"),
    "test_examples": (lambda v: v >= 1, "an int >= 1"),
    "batch_tokens": (lambda v: v >= 1, "an int >= 1"),
    "epochs": (lambda v: v >= 1, "an int >= 1"),
    "vocab_size": (lambda v: v >= 2, "an int >= 2"),
    "power_a": (_positive, "a positive finite float"),
    "head_dim": (lambda v: v >= 1, "an int >= 1"),
    "warmup_frac": (lambda v: 0 <= v < 1, "a float in [0, 1)"),
    "min_lr_ratio": (lambda v: 0 <= v <= 1, "a float in [0, 1]"),
    "weight_decay": (lambda v: math.isfinite(v) and v >= 0, "a finite float >= 0"),
    "betas": (lambda v: len(v) == 2 and all(0 <= x < 1 for x in v), "two float in [0, 1) (e.g. betas=0.9,0.95)"),
    "eps": (_positive, "a positive finite float"),
    "grad_clip": (_positive, "a positive finite float"),
    "workers": (lambda v: v >= 0, "an int >= 0 (0: the device's default)"),
    "streams": (lambda v: v >= 0, "an int >= 0 (0: the device's default)"),
    "threads": (lambda v: v >= 1, "an int >= 1"),
    "init": (lambda v: v in INIT_RULES, f"one of {list(INIT_RULES)}"),
    "precision": (lambda v: v in PRECISIONS, f"one of {list(PRECISIONS)}"),
}
"""Each option's range: ``(test, what it must be)``; :func:`check` refuses a value outside it in one line."""


def check(cfg: MQARConfig) -> None:
    """Raise a one-line ``ValueError`` naming the first option of ``cfg`` out of its range (:data:`RULES`), a list
    option that repeats a value, or a device this machine lacks."""
    for name, (ok, what) in RULES.items():
        value = getattr(cfg, name)
        if not ok(value):
            shown = ",".join(f"{x:g}" if isinstance(x, float) else str(x) for x in value) \
                if isinstance(value, list) else value
            raise ValueError(f"{name}={shown} is out of range: it must be {what}")
    for name in ("mixers", "widths", "settings", "test_settings", "seeds", "lrs"):
        value = getattr(cfg, name)
        twice = sorted({str(x) for x in value if value.count(x) > 1})
        if twice:
            raise ValueError(f"{name} lists {', '.join(twice)} more than once; give each value once")
    if cfg.device != "auto":
        try:
            torch.device(cfg.device)
        except RuntimeError:
            raise ValueError(f"device={cfg.device} is not a device: use auto, cpu or cuda[:N]") from None


def check_models(cfg: MQARConfig) -> None:
    """Build the model of every ``(mixer, width)`` cell of the grid on the meta device (nothing is allocated) as its
    jobs would, with the grid's ``init`` and the mixer's ``precision``: a one-line ``ValueError`` naming the first
    cell that cannot be built (a width that ``head_dim`` does not divide, a mixer's own limits), before any job runs
    or any file is written."""
    for choice in cfg.mixer_choices():
        precision = job_precision(choice.name, dict(choice.kwargs).get("precision", cfg.precision))
        for width in cfg.widths:
            try:
                model = model_config(choice, width, cfg.head_dim, cfg.vocab_size, cfg.init, precision)
                with torch.device("meta"):
                    models.build_model(model)
            except Exception as err:  # noqa: BLE001 - any builder's refusal, reported in one line
                why = (str(err).strip().splitlines() or [type(err).__name__])[0]
                raise ValueError(f"mixer {choice.label} at width {width} (head_dim={cfg.head_dim}) cannot be built: "
                                 f"{why}") from None


def parse_overrides(argv: list[str]) -> tuple[MQARConfig, dict[str, Any]]:
    """``["mixers=kdn_diag,kda", "widths=64", "preset=smoke"]`` -> the config (preset first, then the keys) and
    the explicit overrides, read by ``common.options.parse_options`` (lists are comma-separated; ``quick`` or
    ``--quick`` is ``preset=smoke``). A one-line ``ValueError`` names an unknown key (with a did-you-mean), a value
    not of its option's type, or one out of its range."""
    argv = ["preset=smoke" if arg.lstrip("-") == "quick" else arg for arg in argv]
    explicit, _ = parse_options(MQARConfig, argv, example="mixers=kdn_diag,kda widths=64")
    preset = explicit.get("preset", "auto")
    if preset == "auto":
        preset = "full" if torch.cuda.is_available() else "cpu"
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {['auto', *PRESETS]}")
    cfg = MQARConfig(**{**PRESETS[preset], **explicit, "preset": preset})
    check(cfg)
    check_curve(cfg.curve)
    cfg.budget()  # validates the settings, the budget and the mixers now, not after the first job
    cfg.scored_settings()
    check_models(cfg)
    if not cfg.out:
        cfg.out = f"runs/mqar/{preset}"
    if not cfg.results:
        cfg.results = f"{cfg.out}/mqar{arm_suffix(cfg.init, cfg.precision)}.json"
    return cfg, explicit
