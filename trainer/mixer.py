"""The trainer's mixer and model-override sections: ``mixer`` is a name plus that mixer's options, the fields of
``models.MIXERS[name].config`` (declared, defaulted and checked beside the layer), composed, not restated.

Every option has one spelling, ``mixer.<field>=value``. The Hydra group ``mixer`` is made from the registry
(:func:`store_mixer_configs`): each entry's node is its name and its config's defaults, so a new field or a newly
registered mixer is a training option with no YAML. ``+mixer.kwargs.*`` (the old spelling), an option the chosen
mixer lacks and a ``+model.overrides.*`` typo are refused in one line.
"""
from __future__ import annotations

import difflib
from dataclasses import asdict
from pathlib import Path
from typing import Any

import yaml
from hydra.core.config_store import ConfigStore


class ConfigError(ValueError):
    """A bad config value; the message is one line starting with the dotted key."""


LEGACY_KDN_KEYS = ("mu", "noise", "alpha_param", "precision")
"""The KDN options that run configs written before the mixer section was the mixer's own config kept beside a
``kwargs`` dict (``None`` when unset)."""
MOVED_OVERRIDES = {"window": "backbone.window=<tokens>", "pattern": "backbone.pattern=<pattern>",
                   "mixer": "mixer=<name>", "mixer_kwargs": "mixer.<option>=<value>", "init": "model.init=<rule>",
                   "vocab_size": "the tokenizer's (data.prepare.tokenizer)"}
"""``model.overrides`` keys with a spelling of their own: the spelling to use instead."""


def _close(key: str, names: list[str]) -> str:
    close = difflib.get_close_matches(key, names, n=1)
    return f" (did you mean {close[0]!r}?)" if close else f" (valid keys: {', '.join(names)})"


def store_mixer_configs() -> None:
    """(Re)make the Hydra group ``mixer`` from ``models.MIXERS``: one node a mixer, its name and its config's
    defaults. Call it again after registering a mixer."""
    from models import MIXERS

    store = ConfigStore.instance()
    for name, spec in MIXERS.items():
        store.store(group="mixer", name=name, node={"name": name, **asdict(spec.config())})


def _options(section: dict[str, Any], legacy: bool) -> tuple[str, dict[str, Any]]:
    """``(name, options as given)`` of a mixer section; ``legacy`` reads a recorded run config's older form too."""
    from models import MIXERS

    section = dict(section)
    name = section.pop("name", None)
    if name not in MIXERS:
        raise ConfigError(f"mixer.name: {name!r} is not one of {', '.join(sorted(MIXERS))}")
    if "kwargs" in section:
        extra = section.pop("kwargs") or {}
        if not legacy and extra:
            key, value = next(iter(extra.items()))
            spelling = "backbone.window" if key == "window" else f"mixer.{key}"
            raise ConfigError(f"mixer.kwargs.{key}: use {spelling}={value}")
        section = {k: v for k, v in section.items() if not (k in LEGACY_KDN_KEYS and v is None)}
        section.update(extra)
    return name, section


def _check(name: str, options: dict[str, Any]) -> Any:
    from models import MIXERS
    from models.registry import unknown_option

    spec = MIXERS[name]
    for key in options:
        if key not in spec.kwargs:
            if key == "window":
                raise ConfigError("mixer.window: the attention window is backbone.window (one for every attention "
                                  "layer and mixer=attn)")
            raise ConfigError(f"mixer.{key}: {unknown_option(name, key)}")
    try:
        return spec.options(options)
    except (ValueError, TypeError) as e:
        msg = str(e).splitlines()[0]
        first, _, rest = msg.partition(" ")
        raise ConfigError(f"mixer.{first}: {rest}" if first in spec.kwargs else f"mixer ({name}): {msg}") from None


def canonical_mixer(section: dict[str, Any], legacy: bool = False) -> dict[str, Any]:
    """The mixer section as ``{"name": ..., <every option of that mixer>: value}``, checked by its config."""
    name, options = _options(section, legacy)
    return {"name": name, **asdict(_check(name, options))}


def mixer_choice(section: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``(name, mixer_kwargs)`` of a mixer section (a recorded run's older form too): the options that differ from the
    mixer config's defaults, as that config reads them."""
    from models import MIXERS

    name, options = _options(section, legacy=True)
    defaults = asdict(MIXERS[name].config())
    return name, {k: v for k, v in asdict(_check(name, options)).items() if v != defaults[k]}


def check_model_overrides(overrides: dict[str, Any]) -> dict[str, Any]:
    """``model.overrides`` (extra ``KDNConfig`` fields) as a dict; a key with its own spelling elsewhere or no
    ``KDNConfig`` field is a one-line ``ConfigError`` (with a did-you-mean)."""
    import inspect

    from models import KDNConfig

    names = sorted(n for n in inspect.signature(KDNConfig.__init__).parameters
                   if n not in ("self", "kwargs") and n not in MOVED_OVERRIDES)
    for key in overrides:
        if key in MOVED_OVERRIDES:
            raise ConfigError(f"model.overrides.{key}: use {MOVED_OVERRIDES[key]}")
        if key not in names:
            raise ConfigError(f"model.overrides.{key}: unknown key{_close(key, names)}")
    return dict(overrides)


def _chosen_mixer(args: list[str], conf_dir: Path) -> str:
    """The mixer a command line composes: its ``mixer=``, else its experiment's, else ``conf/config.yaml``'s."""
    for arg in args:
        if arg.lstrip("+").startswith("mixer=") and "," not in arg:
            return arg.split("=", 1)[1]
    files = [conf_dir / "experiment" / f"{a.split('=', 1)[1]}.yaml" for a in args if a.startswith("experiment=")]
    for path in [*files, conf_dir / "config.yaml"]:
        if path.is_file():
            for item in (yaml.safe_load(path.read_text()) or {}).get("defaults", []):
                if isinstance(item, dict):
                    for key, value in item.items():
                        if key.replace("override", "").strip(" /") == "mixer":
                            return str(value)
    return ""


def check_mixer_args(args: list[str], conf_dir: Path) -> None:
    """Refuse, before Hydra composes, a ``mixer.*`` override no mixer takes (did-you-mean), one the chosen mixer
    lacks (naming the mixers that take it) and the old ``mixer.kwargs.*`` spelling (naming the new one)."""
    from models import MIXERS
    from models.registry import unknown_option

    every = sorted({"name"} | {k for spec in MIXERS.values() for k in spec.kwargs})
    for arg in args:
        if arg.startswith(("-", "~")) or "=" not in arg:
            continue
        key, value = arg.lstrip("+").split("=", 1)
        parts = key.split(".")
        if parts[0] != "mixer" or len(parts) < 2:
            continue
        if parts[1] == "kwargs":
            option = parts[2] if len(parts) > 2 else "<option>"
            spelling = "backbone.window" if option == "window" else f"mixer.{option}"
            raise ConfigError(f"{key}: use {spelling}={value}")
        if parts[1] == "window":
            raise ConfigError(f"{key}: use backbone.window={value} (one window for every attention layer)")
        if parts[1] not in every:
            raise ConfigError(f"{key}: unknown key{_close(parts[1], every)}")
        chosen = _chosen_mixer(args, conf_dir)
        if parts[1] != "name" and chosen in MIXERS and parts[1] not in MIXERS[chosen].kwargs:
            raise ConfigError(f"{key}: {unknown_option(chosen, parts[1])}")


store_mixer_configs()
