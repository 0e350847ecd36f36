"""Finished runs under a directory: their experiment identity, evaluation results and training metrics.

A run directory holds ``config.yaml`` (train.py's resolved config), ``metrics.jsonl`` and ``eval/<suite>.json``
(the evaluation suites' results, schema 1). The experiment of a run is read from its config (size, backbone
pattern, mixer and the KDN options); runs that differ only in the training ``seed`` are seeds of one experiment.
Runs may still be writing: a file that cannot be read is left out with one line naming it, never an exception.
"""
from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from common import read_jsonl
from trainer.config import CONF_DIR  # also stores the Hydra nodes conf/ composes with (the mixer group, trainer/schema)

SUITES = ("lm", "ruler", "retrieval", "ppl", "beta_eff")
SCHEMA = 1
KDN_DEFAULTS = {"mu": "dk", "noise": "learned", "alpha_param": "kda"}
NOT_IDENTITY = ("backend", "precision")  # how the mixer computes, not what it is


@dataclass(frozen=True)
class Experiment:
    """What a run trains, independent of its seed. KDN options are ``None`` for the other mixers; ``kwargs``: the
    mixer's other options that differ from its config's defaults (e.g. GDN-2's heads; a run recorded when attention
    kept its own window in ``mixer.kwargs``, that window), without the kernel backend and precision."""

    size: str
    pattern: str
    mixer: str
    mu: str | None = None
    noise: str | None = None
    alpha_param: str | None = None
    kwargs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of_section(cls, size: str, pattern: str, mixer: dict[str, Any]) -> Experiment:
        """The experiment of a run config's mixer section (``trainer.mixer``'s form, or the older one with
        ``kwargs``)."""
        from trainer.mixer import mixer_choice

        mixer = dict(mixer)
        legacy = dict(mixer.get("kwargs") or {})
        window = {"window": legacy.pop("window")} if "window" in legacy else {}
        name, options = mixer_choice({**mixer, "kwargs": legacy} if "kwargs" in mixer else mixer)
        kdn = {k: options.pop(k, None) for k in KDN_DEFAULTS}
        return cls.make(size, pattern, name, **kdn, kwargs={**options, **window})

    @classmethod
    def make(cls, size: str, pattern: str, mixer: str, mu: Any = None, noise: Any = None,
             alpha_param: Any = None, kwargs: dict[str, Any] | None = None) -> Experiment:
        """Normalised identity: KDN options filled with their defaults, dropped for other mixers."""
        from models.registry import KDN_MIXERS

        kw = tuple(sorted((str(k), str(v)) for k, v in (kwargs or {}).items() if k not in NOT_IDENTITY))
        if mixer not in KDN_MIXERS:
            return cls(str(size), str(pattern), str(mixer), kwargs=kw)
        opts = {"mu": mu, "noise": noise, "alpha_param": alpha_param}
        opts = {k: str(v) if v is not None else KDN_DEFAULTS[k] for k, v in opts.items()}
        return cls(str(size), str(pattern), str(mixer), **opts, kwargs=kw)

    def describe(self) -> str:
        """``size/pattern/mixer[ mu=.. noise=.. alpha_param=..][ kwarg=..]``."""
        extra = "".join(f" {k}={getattr(self, k)}" for k in KDN_DEFAULTS if getattr(self, k) is not None)
        extra += "".join(f" {k}={v}" for k, v in self.kwargs)
        return f"{self.size}/{self.pattern}/{self.mixer}{extra}"


@dataclass
class Run:
    """One run directory: identity, seeds, results per suite and its training records."""

    path: Path
    experiment: Experiment
    seed: int
    data_seed: int | None
    results: dict[str, dict[str, Any]] = field(default_factory=dict)
    train: list[dict[str, Any]] = field(default_factory=list)
    val: list[dict[str, Any]] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.path.name


def read_yaml(path: Path) -> dict[str, Any]:
    """A YAML mapping as plain containers (interpolations left unresolved)."""
    data = OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a YAML mapping")
    return data


def report(skipped: list[str] | None, line: str) -> None:
    """Hand one line about a file left out to ``skipped``, or warn it when no list collects them."""
    if skipped is None:
        warnings.warn(line, stacklevel=3)
    else:
        skipped.append(line)


def _torn_reporter(skipped: list[str] | None) -> Callable[[Path, int, str], None]:
    """:func:`common.read_jsonl`'s ``on_torn`` for a run's records: the torn last line is reported to
    ``skipped`` (see :func:`report`)."""
    def torn(path: Path, _: int, line: str) -> None:
        report(skipped, f"skipped the torn last line of {path} ({len(line)} characters; the run is writing it, or "
                        "stopped mid-write)")
    return torn


def read_result(path: Path) -> dict[str, Any]:
    """One ``eval/<suite>.json``; a wrong schema or suite is a ``ValueError`` naming the file."""
    try:
        res = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e.msg}); rerun that evaluation suite") from None
    if not isinstance(res, dict) or res.get("schema") != SCHEMA:
        raise ValueError(f"{path} has schema {res.get('schema') if isinstance(res, dict) else None!r}, expected "
                         f"{SCHEMA}; rerun the suite with this version of evaluate.py")
    if res.get("suite") != path.stem:
        raise ValueError(f"{path} holds suite {res.get('suite')!r}; results files are named eval/<suite>.json")
    return res


def _identity_from_config(cfg: dict[str, Any], path: Path) -> tuple[Experiment, int, int | None]:
    try:
        exp = Experiment.of_section(cfg["model"]["size"], cfg["backbone"]["pattern"], cfg["mixer"])
    except (KeyError, TypeError) as e:
        raise ValueError(f"{path} lacks {e}; it must be the config.yaml that train.py writes") from None
    return exp, int(cfg.get("seed", 0)), (cfg.get("data") or {}).get("seed")


def _identity_from_result(res: dict[str, Any], path: Path) -> tuple[Experiment, int, int | None]:
    m = res.get("model") or {}
    if not all(k in m for k in ("size", "pattern", "mixer")):
        raise ValueError(f"{path}: no config.yaml beside eval/ and its 'model' block lacks size/pattern/mixer; "
                         "evaluate the run directory, not a copy of its results")
    opts = m.get("mixer_options") or {}
    exp = Experiment.make(m["size"], m["pattern"], m["mixer"], opts.get("mu"), opts.get("noise"),
                          opts.get("alpha_param"))
    return exp, int(m.get("seed") or 0), None


# what reading a run's files can raise while a run is still writing them, or after a damaged copy
UNREADABLE = (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException)


def _drop_other_weights(run: Path, results: dict[str, dict[str, Any]], files: dict[str, Path],
                        skipped: list[str] | None) -> None:
    """Leave out the suites computed on other weights (``weights.sha256``) than the run's newest results file (the
    export was replaced since they ran), one line each, so that a run's row never joins two models' numbers."""
    def sha(suite: str) -> str:
        weights = results[suite].get("weights")
        return str((weights.get("sha256") if isinstance(weights, dict) else None) or "unrecorded")

    if not results:
        return
    newest = max(results, key=lambda s: str(results[s].get("date") or ""))
    for suite in [s for s in results if sha(s) != sha(newest)]:
        report(skipped, f"skipped {files[suite]}: computed on other weights (sha256 {sha(suite)[:12]}) than the newest "
                        f"results of {run} ({newest}.json, sha256 {sha(newest)[:12]}); rerun evaluate.py "
                        f"suites=[{suite}] on it")
        del results[suite]


def load_run(path: Path, skipped: list[str] | None = None) -> Run | None:
    """A run from its directory (``config.yaml`` and/or ``eval/*.json``, ``metrics.jsonl`` if present). Results
    written beside the export (``hf/eval/*.json``) count too; where both hold a suite, the run's own is used.

    A file that cannot be read (half-written, damaged, of another schema) is left out and reported to ``skipped``
    (see :func:`report`): a results file drops its suite, ``metrics.jsonl`` its training records, ``config.yaml``
    the whole run (``None``)."""
    results: dict[str, dict[str, Any]] = {}
    files: dict[str, Path] = {}
    for p in [*sorted((path / "hf" / "eval").glob("*.json")), *sorted((path / "eval").glob("*.json"))]:
        if p.stem not in SUITES:
            continue
        try:
            res = read_result(p)
        except UNREADABLE as e:
            report(skipped, f"skipped {_reason(e, p)}")
            continue
        if p.parent.parent == path and p.stem in results:
            report(skipped, f"{path}: both eval/{p.stem}.json and hf/eval/{p.stem}.json exist; using the first")
        results[p.stem], files[p.stem] = res, p
    _drop_other_weights(path, results, files, skipped)
    if not (path / "config.yaml").is_file() and not results:
        report(skipped, f"skipped {path}: no readable config.yaml or eval/<suite>.json")
        return None
    first = next(iter(results), "")
    source = path / "config.yaml" if (path / "config.yaml").is_file() else path / "eval" / f"{first}.json"
    try:
        if source.name == "config.yaml":
            exp, seed, data_seed = _identity_from_config(read_yaml(source), source)
        else:
            exp, seed, data_seed = _identity_from_result(results[first], source)
    except UNREADABLE as e:
        report(skipped, f"skipped the run {path}: {_reason(e, source)}")
        return None
    run = Run(path, exp, seed, data_seed, results)
    if (path / "metrics.jsonl").is_file():
        try:
            rows = read_jsonl(path / "metrics.jsonl", on_torn=_torn_reporter(skipped))
        except UNREADABLE as e:
            report(skipped, f"skipped the training records of {_reason(e, path / 'metrics.jsonl')}")
            rows = []
        run.train = [r for r in rows if "loss" in r]
        run.val = [r for r in rows if "val_loss" in r]
    return run


def _reason(err: BaseException, path: Path) -> str:
    """One line from an exception about ``path``, naming it once."""
    text = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
    return text if str(path) in text else f"{path}: {text}"


def find_runs(root: str | Path, skipped: list[str] | None = None) -> list[Run]:
    """Every run under ``root``, sorted by path.

    Args: ``root``: a folder holding run directories at any depth (a run: ``config.yaml`` and/or
    ``eval/<suite>.json``; results under ``<run>/hf/eval`` belong to ``<run>``); ``skipped``: collects one line per
    file left out because it cannot be read (a run still writing it, a damaged copy, another schema); without it
    those lines are warnings.
    Returns: one :class:`Run` per readable run directory. Raises ``ValueError`` when ``root`` is no directory."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass the folder that holds the run directories (e.g. runs/)")
    dirs = {p.parent for p in root.rglob("config.yaml")}
    dirs |= {p.parent.parent for p in root.rglob("eval/*.json") if p.stem in SUITES}
    dirs = {d for d in dirs if d.name != ".hydra"}  # Hydra's own copy of the config is not a run
    # the results of a run's export (runs/<name>/hf/eval) belong to the run
    dirs = {d.parent if d.name == "hf" and (d.parent / "config.yaml").is_file() else d for d in dirs}
    runs = (load_run(d, skipped) for d in sorted(dirs))
    return [r for r in runs if r is not None]


def preset_identity(preset: str, conf_dir: Path = CONF_DIR) -> Experiment:
    """The experiment a ``conf/experiment/<preset>.yaml`` trains (its overrides on the mixer's defaults)."""
    path = conf_dir / "experiment" / f"{preset}.yaml"
    if not path.is_file():
        raise ValueError(f"no experiment preset {path}; the table definitions and conf/experiment disagree")
    cfg = read_yaml(path)
    picks: dict[str, str] = {}
    for item in cfg.get("defaults", []):
        if isinstance(item, dict):
            for k, v in item.items():
                picks[k.replace("override ", "").strip("/ ")] = str(v)
    mixer = {"name": picks["mixer"], **(cfg.get("mixer") or {})}  # the group mixer is the registry's configs
    backbone = read_yaml(conf_dir / "backbone" / f"{picks['backbone']}.yaml")
    size = read_yaml(conf_dir / "model" / f"{picks['model']}.yaml")["size"]
    return Experiment.of_section(size, backbone["pattern"], mixer)
