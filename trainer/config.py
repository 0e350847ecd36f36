"""Typed schema of the Hydra config tree (``conf/``) and its validation.

``load_config(dict_config)`` merges the composed config into the dataclasses below and checks every
value; any problem raises ``ConfigError`` with one line that names the key, e.g.
``trainer.max_stepz: unknown key (did you mean 'max_steps'?)``. ``derive_budget`` turns the token
budget and global batch into optimiser steps, gradient accumulation and warm-up.
"""
from __future__ import annotations

import difflib
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from functools import partial
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common import OptionError, did_you_mean, from_dict
from trainer.mixer import ConfigError, canonical_mixer, check_mixer_args, check_model_overrides, mixer_choice
from trainer.preemption import parse_signal
from trainer.rundir import run_overrides

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"


@dataclass
class ModelConfig:
    size: str = "small"  # models.model_config size: toy, small, 100m, 750m, 1.3b
    init: str = "fla"  # weight initialisation: fla (N(0, 0.02)) or authors (lit-gpt's mamba_init; models/README.md)
    overrides: dict[str, Any] = field(default_factory=dict)  # extra KDNConfig fields, e.g. {num_layers: 2}


@dataclass
class BackboneConfig:
    pattern: str = "recurrent"  # recurrent, hybrid_swa, or a layer string (R mixer, S sliding window, A full)
    window: int | None = None  # the attention window (sliding layers, mixer=attn); null: the size's (models.SIZES)


@dataclass
class DataConfig:
    prepare: dict[str, Any] = field(default_factory=dict)  # data.PrepareConfig fields
    auto_prepare: bool = True  # run data.prepare (idempotent) at start; else read prepare.out_dir as is
    seq_len: int = 256
    varlen: bool = False  # pack documents with cu_seqlens (state resets at boundaries)
    seed: int = 0  # one data seed shared by every mixer of a comparison
    num_workers: int = 0  # batch-building worker processes per rank


@dataclass
class OptimConfig:
    lr: float = 4e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.1
    eps: float = 1e-8
    grad_clip: float = 1.0
    warmup_frac: float = 0.01  # of the optimiser steps (= of the token budget)
    min_lr_ratio: float = 0.1  # cosine floor, as a fraction of the peak


@dataclass
class TrainerConfig:
    token_budget: int = 20_000_000
    global_batch_tokens: int = 4096  # tokens per optimiser step over all processes
    micro_batch_size: int = 8  # sequences per process per forward
    max_steps: int | None = None  # overrides the token budget
    stop_after: int | None = None  # save and exit 0 after this step; the schedule keeps the full budget
    eval_every: int = 100  # 0: only at the end
    eval_batches: int = 8  # validation micro-batches over all processes (each runs ceil(n / world))
    ckpt_every: int = 100  # 0: only at the end (and on stop_after/preemption); -1: not at the end either
    keep_last: int = 2
    distributed: str = "ddp"  # ddp or fsdp (FSDP2 through accelerate)
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU), bf16, fp32
    device: str = "auto"  # auto, cpu, cuda
    compile: bool = False  # torch.compile through accelerate's dynamo plugin
    peak_flops: float | None = None  # per-device FLOP/s for MFU; auto for known GPUs in bf16
    preempt_signals: list[str] = field(default_factory=lambda: ["SIGUSR1", "SIGUSR2", "SIGTERM"])
    export: bool = True  # write <run_dir>/hf at the end
    reshard: bool = False  # allow resuming on another world size (same global data cursor; not bit-exact)
    recompute_states: bool = False  # CUDA: the delta-rule memories' backward recomputes what their forward could keep
    # (passed to the model config's recompute_states)
    check_weights_every: int = 1  # steps between checks that the updated weights are finite (0: only before saves)


# conf/trainer/*.yaml hold only what differs from these defaults, on top of this node
ConfigStore.instance().store(group="trainer", name="schema", node=asdict(TrainerConfig()))


@dataclass
class WandbConfig:
    mode: str = "offline"  # offline, online, disabled
    project: str = "kdn"
    entity: str | None = None


@dataclass
class ProfileConfig:
    start: int = 10  # profile the optimiser steps start + 1 .. start + steps (trainer.profiling.StepProfiler)
    steps: int = 0  # 0: off; else <run_dir>/profile/summary.json and trace.json.gz from the main process (a log
    # interval holding profiled steps reports no tokens/s; the next one starts after the profile)


@dataclass
class LoggingConfig:
    log_every: int = 10
    progress: bool = True  # tqdm line on a terminal, else a log line every log_every steps
    wandb: WandbConfig = field(default_factory=WandbConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


@dataclass
class TrainConfig:
    name: str = "run"
    runs_root: str = "runs"
    run_dir: str = "runs/run"
    resume: str = "auto"  # auto: resume only the same experiment (trainer.rundir); force: adopt the changed config;
    # restart: start over a run directory whose training left no intact checkpoint (its records kept aside)
    seed: int = 0  # model initialisation
    model: ModelConfig = field(default_factory=ModelConfig)
    mixer: dict[str, Any] = field(default_factory=lambda: {"name": "kdn_diag"})  # name + that mixer's options
    # (the fields of models.MIXERS[name].config; trainer.mixer)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)


# conf/config.yaml's default name appends the experiment-changing command-line overrides, with their values as
# this schema reads them: ${run_overrides:}
OmegaConf.register_new_resolver("run_overrides", partial(run_overrides, TrainConfig), replace=True)


@dataclass(frozen=True)
class StepBudget:
    """Step arithmetic derived from the token budget and the batch (docs/protocol.md §8)."""

    total_steps: int
    grad_accum: int
    warmup_steps: int
    tokens_per_step: int


def derive_budget(cfg: TrainConfig, world_size: int) -> StepBudget:
    """Optimiser steps, gradient accumulation and warm-up; ``ConfigError`` if the batch does not split."""
    t = cfg.trainer
    per_micro = t.micro_batch_size * cfg.data.seq_len * world_size
    if t.global_batch_tokens % per_micro:
        raise ConfigError(
            f"trainer.global_batch_tokens: {t.global_batch_tokens} is not a multiple of micro_batch_size x "
            f"seq_len x world_size = {t.micro_batch_size} x {cfg.data.seq_len} x {world_size} = {per_micro}; "
            "change trainer.global_batch_tokens or trainer.micro_batch_size")
    steps = t.max_steps if t.max_steps is not None else t.token_budget // t.global_batch_tokens
    if steps < 1:
        raise ConfigError(
            f"trainer.token_budget: {t.token_budget} tokens is less than one global batch "
            f"({t.global_batch_tokens}); raise the budget or set trainer.max_steps")
    return StepBudget(total_steps=steps, grad_accum=t.global_batch_tokens // per_micro,
                  warmup_steps=math.ceil(cfg.optim.warmup_frac * steps), tokens_per_step=t.global_batch_tokens)


def _first_line(e: OmegaConfBaseException) -> str:
    return str(getattr(e, "msg", e)).splitlines()[0]


def _unknown_key_hint(full_key: str) -> str:
    parts = full_key.split(".")
    node: Any = TrainConfig
    for p in parts[:-1]:
        hints = {f.name: f for f in fields(node)} if is_dataclass(node) else {}
        if p not in hints or not isinstance(hints[p].default_factory, type):
            return ""
        node = hints[p].default_factory
    names = [f.name for f in fields(node)] if is_dataclass(node) else []
    close = difflib.get_close_matches(parts[-1], names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(names)})"


def override_keys(args: list[str], conf_dir: Path, added: bool) -> Iterator[list[str]]:
    """The dotted keys, split, of the ``key=value`` overrides in ``args`` that name config values; flags, deletions
    (``~key``), config groups of ``conf_dir``, ``@``/``/`` keys and ``hydra.*`` are left to Hydra, and so are added
    keys (``+key``, ``++key``) unless ``added``."""
    groups = {p.name for p in conf_dir.iterdir() if p.is_dir()}
    for arg in args:
        if arg.startswith(("-", "~")) or "=" not in arg or (arg.startswith("+") and not added):
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        parts = key.split(".")
        if not any(c in key for c in "@/") and parts[0] != "hydra" and key not in groups:
            yield parts


def check_override_keys(args: list[str]) -> None:
    """Refuse a plain ``key=value`` command-line override (no ``+``/``~``) whose key the schema lacks, in one line
    with a did-you-mean, before Hydra composes (which answers with a generic message). Flags, ``hydra.*`` keys and
    the keys inside free-form dicts (``model.overrides``, ``mixer.kwargs``) are left to Hydra.

    Args:
        args: the command line after the program name.
    Raises:
        ConfigError: ``trainer.max_step: unknown key (did you mean 'max_steps'?)``.
    """
    from data import PrepareConfig

    check_mixer_args(args, CONF_DIR)
    for parts in override_keys(args, CONF_DIR, added=False):
        if parts[0] == "mixer":
            continue
        node: Any = TrainConfig
        for i, part in enumerate(parts):
            names = {f.name for f in fields(node)}
            if part not in names:
                raise ConfigError(did_you_mean(".".join(parts[:i + 1]), names))
            factory = next(f.default_factory for f in fields(node) if f.name == part)
            if ".".join(parts[:i + 1]) == "data.prepare":
                node = PrepareConfig
            elif isinstance(factory, type) and is_dataclass(factory):
                node = factory
            else:
                break


def _require(ok: bool, key: str, msg: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {msg}")


def _choice(value: str, key: str, choices: tuple[str, ...] | list[str]) -> None:
    _require(value in choices, key, f"{value!r} is not one of {', '.join(choices)}")


def _check_numbers(c: TrainConfig) -> None:
    o, t = c.optim, c.trainer
    for key in ("lr", "eps", "weight_decay"):
        _require(math.isfinite(getattr(o, key)), f"optim.{key}", f"must be a finite number, got {getattr(o, key)}")
    _require(o.lr > 0, "optim.lr", f"must be > 0, got {o.lr}")
    _require(len(o.betas) == 2 and all(0 <= b < 1 for b in o.betas), "optim.betas",
             f"must be two numbers in [0, 1), got {o.betas}")
    _require(o.weight_decay >= 0, "optim.weight_decay", f"must be >= 0, got {o.weight_decay}")
    _require(o.eps > 0, "optim.eps", f"must be > 0, got {o.eps}")
    _require(o.grad_clip > 0, "optim.grad_clip", f"must be > 0, got {o.grad_clip}")
    _require(0 <= o.warmup_frac < 1, "optim.warmup_frac", f"must be in [0, 1), got {o.warmup_frac}")
    _require(0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", f"must be in [0, 1], got {o.min_lr_ratio}")
    for key in ("token_budget", "global_batch_tokens", "micro_batch_size", "eval_batches", "keep_last"):
        _require(getattr(t, key) >= 1, f"trainer.{key}", f"must be >= 1, got {getattr(t, key)}")
    for key in ("max_steps", "stop_after"):
        value = getattr(t, key)
        _require(value is None or value >= 1, f"trainer.{key}", f"must be >= 1 or null, got {value}")
    _require(t.eval_every >= 0, "trainer.eval_every", f"must be >= 0 (0 = only at the end), got {t.eval_every}")
    _require(t.ckpt_every >= -1, "trainer.ckpt_every",
             f"must be >= -1 (0 = only at the end, -1 = only on preemption), got {t.ckpt_every}")
    _require(t.check_weights_every >= 0, "trainer.check_weights_every",
             f"must be >= 0 (0 = only before checkpoints), got {t.check_weights_every}")
    _choice(c.resume, "resume", ("auto", "force", "restart"))
    _require(t.peak_flops is None or t.peak_flops > 0, "trainer.peak_flops", f"must be > 0 or null, got {t.peak_flops}")
    _choice(t.distributed, "trainer.distributed", ("ddp", "fsdp"))
    _choice(t.precision, "trainer.precision", ("auto", "bf16", "fp32"))
    _choice(t.device, "trainer.device", ("auto", "cpu", "cuda"))
    for i, s in enumerate(t.preempt_signals):
        try:
            parse_signal(s)
        except ValueError as e:
            raise ConfigError(f"trainer.preempt_signals[{i}]: {e}") from None
    _require(c.data.seq_len >= 2, "data.seq_len", f"must be >= 2, got {c.data.seq_len}")
    _require(c.data.num_workers >= 0, "data.num_workers", f"must be >= 0, got {c.data.num_workers}")
    _require(c.logging.log_every >= 1, "logging.log_every", f"must be >= 1, got {c.logging.log_every}")
    for key in ("start", "steps"):
        value = getattr(c.logging.profile, key)
        _require(value >= 0, f"logging.profile.{key}", f"must be >= 0, got {value}")
    _choice(c.logging.wandb.mode, "logging.wandb.mode", ("offline", "online", "disabled"))


def _check_data(d: DataConfig) -> None:
    from data import PrepareConfig

    try:  # each key and each value's type, as data.prepare's own command line checks them
        from_dict(PrepareConfig, dict(d.prepare), prefix="data.prepare.")
    except OptionError as e:
        raise ConfigError(str(e)) from None
    _require(d.auto_prepare or bool(d.prepare.get("out_dir")), "data.prepare.out_dir",
             "must name the prepared shard directory when data.auto_prepare is false")


def build_model_config(c: TrainConfig, vocab_size: int) -> Any:
    """``models.model_config`` for this run; ``ConfigError`` naming the model keys on a bad combination."""
    from models import SIZES, model_config

    _choice(c.model.size, "model.size", list(SIZES))
    overrides = check_model_overrides(c.model.overrides)
    name, options = mixer_choice(c.mixer)
    overrides.setdefault("init", c.model.init)
    # memory against speed (docs/results/training.md)
    overrides.setdefault("recompute_states", c.trainer.recompute_states)
    if c.backbone.window is not None:
        overrides["window"] = c.backbone.window
    try:
        return model_config(c.model.size, name, c.backbone.pattern, vocab_size, mixer_kwargs=options, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model (size {c.model.size}, mixer {name}, pattern {c.backbone.pattern}): "
                          f"{str(e).splitlines()[0]}") from None


def load_config(cfg: DictConfig | dict[str, Any]) -> TrainConfig:
    """Validate a composed config; return the typed ``TrainConfig`` (its mixer section canonical: the name and every
    option of that mixer) or raise a one-line ``ConfigError``. The model itself is checked where it is built, once,
    from the data's vocabulary (:func:`build_model_config`), and the batch split where the launcher's world size is
    known (:func:`derive_budget`)."""
    raw = cfg if isinstance(cfg, DictConfig) else OmegaConf.create(cfg)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), raw)
        c: TrainConfig = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "config"
        msg = _first_line(e)
        if msg.startswith("Key ") and "not in" in msg:
            msg = "unknown key" + _unknown_key_hint(key)
        raise ConfigError(f"{key}: {msg}") from None
    _check_numbers(c)
    c.mixer = canonical_mixer(c.mixer)
    check_model_overrides(c.model.overrides)
    _check_data(c.data)
    return c
