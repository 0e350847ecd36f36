"""Finished runs under a directory: their experiment identity, evaluation results and training metrics.

A run directory holds ``config.yaml`` (train.py's resolved config), ``metrics.jsonl`` and ``eval/<suite>.json``
(the evaluation suites' results, schema 1). The experiment of a run is read from its config (size, backbone
pattern, mixer and the KDN options); runs that differ only in the training ``seed`` are seeds of one experiment.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

SUITES = ("lm", "ruler", "retrieval", "ppl")
SCHEMA = 1
KDN_MIXERS = ("kdn_diag", "kdn_iso")
KDN_DEFAULTS = {"mu": "dk", "noise": "learned", "alpha_param": "kda"}
CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


@dataclass(frozen=True)
class Experiment:
    """What a run trains, independent of its seed. KDN options are ``None`` for the other mixers; ``kwargs``: the
    mixer's other keyword arguments (``mixer.kwargs``, e.g. an attention window), without the kernel backend."""

    size: str
    pattern: str
    mixer: str
    mu: str | None = None
    noise: str | None = None
    alpha_param: str | None = None
    kwargs: tuple[tuple[str, str], ...] = ()

    @classmethod
    def make(cls, size: str, pattern: str, mixer: str, mu: Any = None, noise: Any = None,
             alpha_param: Any = None, kwargs: dict[str, Any] | None = None) -> Experiment:
        """Normalised identity: KDN options filled with their defaults, dropped for other mixers."""
        kw = tuple(sorted((str(k), str(v)) for k, v in (kwargs or {}).items() if k != "backend"))
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


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """The records of a JSON-lines file; a torn last line (a run stopped mid-write) is skipped with a warning."""
    lines = path.read_text().splitlines()
    out = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) - 1:
                warnings.warn(f"{path}: skipped a torn last line ({len(line)} characters)", stacklevel=2)
                break
            raise ValueError(f"{path}:{i + 1} is not JSON ({e.msg}); repair or remove that line") from None
    return out


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
        mixer = cfg["mixer"]
        exp = Experiment.make(cfg["model"]["size"], cfg["backbone"]["pattern"], mixer["name"], mixer.get("mu"),
                              mixer.get("noise"), mixer.get("alpha_param"), mixer.get("kwargs"))
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


def load_run(path: Path) -> Run:
    """A run from its directory (``config.yaml`` and/or ``eval/*.json``, ``metrics.jsonl`` if present). Results
    written beside the export (``hf/eval/*.json``) count too; where both hold a suite, the run's own is used."""
    results = {p.stem: read_result(p) for p in sorted((path / "hf" / "eval").glob("*.json")) if p.stem in SUITES}
    for p in sorted((path / "eval").glob("*.json")):
        if p.stem in SUITES:
            if p.stem in results:
                warnings.warn(f"{path}: both eval/{p.stem}.json and hf/eval/{p.stem}.json exist; using the first",
                              stacklevel=2)
            results[p.stem] = read_result(p)
    if (path / "config.yaml").is_file():
        exp, seed, data_seed = _identity_from_config(read_yaml(path / "config.yaml"),
                                                     path / "config.yaml")
    elif results:
        first = next(iter(results))
        exp, seed, data_seed = _identity_from_result(results[first], path / "eval" / f"{first}.json")
    else:
        raise ValueError(f"{path} has neither config.yaml nor eval/<suite>.json")
    run = Run(path, exp, seed, data_seed, results)
    if (path / "metrics.jsonl").is_file():
        rows = read_jsonl(path / "metrics.jsonl")
        run.train = [r for r in rows if "loss" in r]
        run.val = [r for r in rows if "val_loss" in r]
    return run


def find_runs(root: str | Path) -> list[Run]:
    """Every run under ``root``, sorted by path.

    Args: ``root``: a folder holding run directories at any depth (a run: ``config.yaml`` and/or
    ``eval/<suite>.json``; results under ``<run>/hf/eval`` belong to ``<run>``).
    Returns: one :class:`Run` per directory. Raises ``ValueError`` for a results file of another schema or a
    corrupt line inside ``metrics.jsonl`` (a torn last line is skipped with a warning)."""
    root = Path(root)
    if not root.is_dir():
        raise ValueError(f"{root} is not a directory; pass the folder that holds the run directories (e.g. runs/)")
    dirs = {p.parent for p in root.rglob("config.yaml")}
    dirs |= {p.parent.parent for p in root.rglob("eval/*.json") if p.stem in SUITES}
    dirs = {d for d in dirs if d.name != ".hydra"}  # Hydra's own copy of the config is not a run
    # the results of a run's export (runs/<name>/hf/eval) belong to the run
    dirs = {d.parent if d.name == "hf" and (d.parent / "config.yaml").is_file() else d for d in dirs}
    return [load_run(d) for d in sorted(dirs)]


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
    mixer_conf = read_yaml(conf_dir / "mixer" / f"{picks['mixer']}.yaml")
    mixer = {**mixer_conf, **(cfg.get("mixer") or {})}
    backbone = read_yaml(conf_dir / "backbone" / f"{picks['backbone']}.yaml")
    size = read_yaml(conf_dir / "model" / f"{picks['model']}.yaml")["size"]
    return Experiment.make(size, backbone["pattern"], mixer["name"], mixer.get("mu"), mixer.get("noise"),
                           mixer.get("alpha_param"), mixer.get("kwargs"))
