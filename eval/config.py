"""Typed schema of ``evaluate.py``'s config (``conf/eval/``), composed of each suite's options, and its checks.

``load_eval_config(composed)`` checks every value of a composed config against the dataclasses below and returns
:class:`EvalConfig`; ``check_override_keys(argv)`` refuses a command-line key the schema lacks before Hydra
composes. Any problem is one :class:`common.options.OptionError` line (a ``ValueError``) naming the key, e.g.
``ruler.sample_per_cell: unknown key (did you mean 'samples_per_cell'?)`` or ``dtype: 'bogus' is not one of
'auto', 'bfloat16', 'float32', 'float16'``. ``conf/eval/config.yaml`` documents each key; a test keeps its values
equal to these defaults.
"""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field, is_dataclass
from typing import Any, Literal

from common.options import OptionError, did_you_mean, field_types, from_dict
from eval.ruler_suite import RulerOptions
from eval.suites import BetaEffOptions, LmOptions, PplOptions, RetrievalOptions
from trainer.config import CONF_DIR

EVAL_CONF_DIR = CONF_DIR / "eval"  # the evaluation's groups and presets, beside the training config's
SUITES = ("lm", "ruler", "retrieval", "ppl", "beta_eff")
MISSING = "???"


@dataclass
class EvalConfig:
    """``python evaluate.py model=... [key=value ...]``: what to evaluate, where, and each suite's options."""

    model: str = field(default=MISSING, metadata={"help": "runs/<name>, runs/<name>/hf or a checkpoint dir"})
    suites: list[str] = field(default_factory=lambda: ["lm", "ruler", "retrieval"])  # any of SUITES
    out_dir: str | None = None  # None: <run dir>/eval
    overwrite: bool = False  # recompute finished suites and cells
    log_samples: bool = False  # also <suite>.samples.jsonl
    device: str = "auto"  # auto (cuda when present), cpu, cuda, cuda:1
    dtype: Literal["auto", "bfloat16", "float32", "float16"] = "auto"  # auto: bfloat16 on CUDA, float32 on CPU
    batch_size: int | Literal["auto"] = "auto"
    max_length: int | None = None  # lm-eval's context; None: the run's training context
    offline: bool = False  # hub datasets only from the local Hugging Face cache
    skip_unavailable: bool = False  # a task whose data cannot be reached is skipped and reported
    progress: bool = True
    expected: str | None = None  # a preset's note on what its model should score
    lm: LmOptions = field(default_factory=LmOptions)
    ruler: RulerOptions = field(default_factory=RulerOptions)
    retrieval: RetrievalOptions = field(default_factory=RetrievalOptions)
    ppl: PplOptions = field(default_factory=PplOptions)
    beta_eff: BetaEffOptions = field(default_factory=BetaEffOptions)


def load_eval_config(composed: Any) -> EvalConfig:
    """The typed config of a composed one (an OmegaConf ``DictConfig`` or a plain mapping; a ``hydra`` node is
    ignored); a one-line ``OptionError`` for an unknown key, a value of the wrong type or a missing ``model``."""
    from omegaconf import DictConfig, OmegaConf

    data = OmegaConf.to_container(composed, resolve=True) if isinstance(composed, DictConfig) else dict(composed)
    data.pop("hydra", None)
    cfg = from_dict(EvalConfig, data)
    if cfg.model == MISSING:
        raise OptionError("model: missing; pass model=runs/<name> (a run, its hf/ export or a checkpoint directory)")
    return cfg


def check_override_keys(args: list[str]) -> None:
    """Refuse a command-line override whose key :class:`EvalConfig` lacks, plain or added (``+key``, ``++key``), in
    one line with a did-you-mean, before Hydra composes: Hydra answers a plain typo by advising a ``+``, and adds a
    ``+`` key that nothing reads. Every argument is checked, the first included, and a config group's value
    (``preset=quick``) must name one of its files. Flags, deletions (``~key``), ``hydra/launcher`` and ``hydra.*``
    keys are left to Hydra.

    Raises:
        OptionError: ``ruler.sample_per_cell: unknown key (did you mean 'samples_per_cell'?)``.
    """
    groups = {p.name for p in EVAL_CONF_DIR.iterdir() if p.is_dir()}
    for arg in args:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key, value = arg.split("=", 1)
        key = key.lstrip("+")
        parts = key.split(".")
        if key in groups:  # a config group: each value (a -m sweep lists several) names one of its files
            choices = sorted(p.stem for p in (EVAL_CONF_DIR / key).glob("*.yaml"))
            for choice in value.split(","):
                if choice not in (*choices, "null"):
                    close = difflib.get_close_matches(choice, choices, n=1)
                    raise OptionError(f"{key}={choice!r} is not one of {', '.join(choices)}"
                                      + (f" (did you mean {close[0]!r}?)" if close else ""))
            continue
        if any(c in key for c in "@/") or parts[0] == "hydra":
            continue
        node: Any = EvalConfig
        for i, part in enumerate(parts):
            names = field_types(node)
            if part not in names:
                raise OptionError(did_you_mean(".".join(parts[:i + 1]), names))
            node = names[part]
            if not is_dataclass(node):  # below a value: Hydra's own error names it
                break


def top_level_keys() -> set[str]:
    """The first key parts an ``evaluate.py`` override may start with: the schema's fields, the config groups and
    ``hydra``."""
    return {*field_types(EvalConfig), *(p.name for p in EVAL_CONF_DIR.iterdir() if p.is_dir()), "hydra"}
