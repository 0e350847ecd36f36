"""docs/extending.md's two walk-throughs, end to end on the CPU: a mixer defined here, registered through the public
registry, with a knob in its config dataclass, reaches the training config, its overrides, the model and a forward,
with no other file touched."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn
from hydra import compose, initialize_config_dir
from torch import Tensor

from models import MIXERS, MixerSpec, build_model
from trainer.config import ConfigError, build_model_config, check_override_keys, load_config
from trainer.mixer import store_mixer_configs

CONF = Path(__file__).resolve().parents[1] / "conf"
NAME = "toy_scaled"


@dataclass
class ScaledConfig:
    """The toy mixer's options: its one knob, checked once, here."""

    scale: float = 1.0

    def __post_init__(self) -> None:
        if not self.scale > 0:
            raise ValueError(f"scale must be > 0, got {self.scale}")


class Scaled(nn.Module):
    """A token-wise mixer, ``o = scale * W x`` (``x [B, T, d]``): the smallest layer a model block can hold."""

    def __init__(self, hidden_size: int, config: ScaledConfig) -> None:
        super().__init__()
        self.config = config
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states: Tensor, **kwargs: Any) -> tuple[Tensor, None, Any]:
        return self.config.scale * self.proj(hidden_states), None, kwargs.get("past_key_values")


@pytest.fixture
def toy_mixer() -> Iterator[MixerSpec]:
    spec = MIXERS.register(MixerSpec(NAME, ScaledConfig, lambda cfg, idx, kw: Scaled(cfg.hidden_size,
                                                                                     ScaledConfig(**kw)),
                                     lambda cfg, idx, kw: 0))
    store_mixer_configs()  # the training config's group `mixer` is the registry's
    try:
        yield spec
    finally:
        del MIXERS[NAME]


def _run(overrides: list[str]) -> Any:
    check_override_keys(overrides)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_config(compose("config", overrides=["model=toy", *overrides]))


def test_a_registered_mixer_and_its_knob_train_with_no_other_file(toy_mixer: MixerSpec) -> None:
    c = _run([f"mixer={NAME}", "mixer.scale=2.5"])
    assert c.mixer == {"name": NAME, "scale": 2.5}
    mc = build_model_config(c, 512)
    assert (mc.mixer, mc.mixer_kwargs, mc.mixer_options) == (NAME, {"scale": 2.5}, ScaledConfig(2.5))
    torch.manual_seed(0)
    model = build_model(mc).eval()
    layer = model.model.layers[0].mixer
    assert isinstance(layer, Scaled) and layer.config.scale == 2.5
    tokens = torch.randint(3, 512, (2, 9), generator=torch.Generator().manual_seed(1))
    x = torch.randn(2, 9, mc.hidden_size, generator=torch.Generator().manual_seed(2))
    o, _, _ = layer(x)
    ref = 2.5 * x @ layer.proj.weight.T
    assert ((o - ref).norm() / ref.norm()).item() < 1e-6  # the knob reaches the layer's computation
    with torch.no_grad():
        logits = model(tokens).logits
    assert logits.shape == (2, 9, 512) and logits.isfinite().all()
    assert build_model_config(_run([f"mixer={NAME}"]), 512).mixer_kwargs == {}  # the default, declared once


def test_the_knob_is_refused_where_it_does_not_apply(toy_mixer: MixerSpec) -> None:
    with pytest.raises(ConfigError, match=r"^mixer.scale: must be > 0, got -1.0$"):
        _run([f"mixer={NAME}", "mixer.scale=-1.0"])
    with pytest.raises(ConfigError) as e:
        _run(["mixer=kda", "mixer.scale=2"])
    assert str(e.value) == f"mixer.scale: mixer 'kda' does not take 'scale'; the mixers taking it: {NAME}"
    with pytest.raises(ConfigError) as e:
        _run([f"mixer={NAME}", "mixer.scael=2"])
    assert str(e.value) == "mixer.scael: unknown key (did you mean 'scale'?)"
    with pytest.raises(ConfigError) as e:
        _run([f"mixer={NAME}", "+mixer.kwargs.scale=2"])
    assert str(e.value) == "mixer.kwargs.scale: use mixer.scale=2"
