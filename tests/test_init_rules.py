"""The weight initialisation rules (``KDNConfig.init``, models/README.md "Initialisation"), checked for every mixer by
value (which weights are zero, which keep the default draw, the rescale factor) and by distribution (each weight's
standard deviation and range against the rule's, per layer type)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import models
from models.configuration import INIT_RULES

MIXERS = sorted(models.MIXERS)
NUM_LAYERS = 2  # the toy size's
RESIDUAL_SCALE = math.sqrt(2 * NUM_LAYERS)
# the projections the authors' rule rescales, by the name lit-gpt's list matches: the FFN's output (their w3),
# attention's output (their proj) and Mamba's out_proj; the delta mixers' o_proj is not among them
RESIDUAL = {"attn": ("mlp.down_proj.weight", "mixer.o_proj.weight"),
            "mamba3_siso": ("mlp.down_proj.weight", "mixer.out_proj.weight"),
            "mamba3_mimo": ("mlp.down_proj.weight", "mixer.out_proj.weight")}


def build(mixer: str, init: str, seed: int = 0, **overrides: object) -> nn.Module:
    torch.manual_seed(seed)
    return models.build_model(models.model_config("toy", mixer, init=init, **overrides))


def weights(model: nn.Module) -> dict[str, tuple[nn.Module, torch.Tensor]]:
    """``{name: (module, weight)}`` of every linear and conv weight."""
    return {f"{name}.weight": (m, m.weight.detach()) for name, m in model.named_modules()
            if isinstance(m, (nn.Linear, nn.Conv1d))}


def std_tolerance(n: int, kurtosis: float) -> float:
    """Five standard errors of a sample standard deviation over ``n`` values (relative)."""
    return 5 * math.sqrt((kurtosis - 1) / (4 * n))


def is_omega(mixer: str, name: str) -> bool:
    return ((mixer == "kdn_diag" and "mixer.omega_proj.1." in name)
            or (mixer == "kdn_iso" and "mixer.omega_proj." in name))


@pytest.mark.parametrize("mixer", MIXERS)
def test_authors_rule_draws_default_uniform_weights_rescales_residual_outputs(mixer: str) -> None:
    model = build(mixer, "authors")
    residual = RESIDUAL.get(mixer, ("mlp.down_proj.weight",))
    for name, (module, w) in weights(model).items():
        if mixer == "kdn_diag" and is_omega(mixer, name):
            continue
        scale = RESIDUAL_SCALE if name.endswith(residual) else 1.0
        bound = 1 / math.sqrt(w[0].numel()) / scale
        std = w.float().std().item()
        # uniform on [-bound, bound]: std bound / sqrt(3), kurtosis 1.8, and draws close to both ends
        assert abs(std / (bound / math.sqrt(3)) - 1) <= std_tolerance(w.numel(), 1.8), (name, std, bound)
        assert w.abs().max().item() <= bound * (1 + 1e-6), (name, "beyond the rule's range")
        if w.numel() >= 128:
            assert w.abs().max().item() >= 0.9 * bound, (name, "narrower than the rule's range")
        if getattr(module, "bias", None) is not None:
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), f"{name}: bias not zero"
    emb = model.model.embeddings.weight.detach()
    assert abs(emb.std().item() / 0.02 - 1) <= std_tolerance(emb.numel(), 3.0)


@pytest.mark.parametrize("mixer", MIXERS)
def test_fla_rule_draws_normal_weights_and_zero_biases(mixer: str) -> None:
    model = build(mixer, "fla")
    for name, (module, w) in weights(model).items():
        if is_omega(mixer, name):
            assert torch.equal(w, torch.zeros_like(w)) and torch.equal(module.bias, torch.zeros_like(module.bias))
            continue
        assert abs(w.float().std().item() / 0.02 - 1) <= std_tolerance(w.numel(), 3.0), name
        if getattr(module, "bias", None) is not None:
            assert torch.equal(module.bias, torch.zeros_like(module.bias)), f"{name}: bias not zero"


@pytest.mark.parametrize("mixer", MIXERS)
def test_the_rules_differ_only_in_linear_conv_and_embedding_weights(mixer: str) -> None:
    """Same seed, both rules: the mixer-specific parameters and the norms are the constructor's under both."""
    fla, authors = build(mixer, "fla").state_dict(), build(mixer, "authors").state_dict()
    drawn = set(weights(build(mixer, "fla"))) | {"model.embeddings.weight"}
    for name, value in fla.items():
        if name not in drawn and not name.endswith(".bias"):
            assert torch.equal(value, authors[name]), name


def test_process_noise_under_the_authors_rule() -> None:
    """Diagonal KDN's last omega stage stays zero (weight and bias); Isotropic KDN's omega gets the default weight draw
    and a zero bias, as the authors' packed projection does."""
    diag = build("kdn_diag", "authors").model.layers[0].mixer.omega_proj[1]
    assert torch.equal(diag.weight, torch.zeros_like(diag.weight))
    assert torch.equal(diag.bias, torch.zeros_like(diag.bias))
    iso = build("kdn_iso", "authors").model.layers[0].mixer.omega_proj
    bound = 1 / math.sqrt(iso.in_features)
    assert iso.weight.abs().max() <= bound and iso.weight.abs().min() > 0
    assert abs(iso.weight.std().item() / (bound / math.sqrt(3)) - 1) <= std_tolerance(iso.weight.numel(), 1.8)
    assert torch.equal(iso.bias, torch.zeros_like(iso.bias))
    assert torch.equal(build("kdn_iso", "fla").model.layers[0].mixer.omega_proj.weight, torch.zeros(2, 64))


def test_hybrid_attention_layers_rescale_their_output() -> None:
    model = build("kda", "authors", pattern="RS")
    delta, attn = model.model.layers[0].mixer.front.o_proj.weight, model.model.layers[1].mixer.o_proj.weight
    assert math.isclose(delta.abs().max().item(), 1 / 8, rel_tol=0.02)  # fan-in 64, unscaled
    assert math.isclose(attn.abs().max().item(), 1 / 8 / RESIDUAL_SCALE, rel_tol=0.02)


def test_a_tied_head_keeps_the_embedding_draw() -> None:
    model = build("kda", "authors", tie_word_embeddings=True)
    assert model.lm_head.weight.data_ptr() == model.model.embeddings.weight.data_ptr()
    assert abs(model.lm_head.weight.std().item() / 0.02 - 1) <= 0.01


def test_the_default_is_fla_and_the_rule_is_saved() -> None:
    assert models.KDNConfig().init == "fla" == INIT_RULES[0]
    fla = build("kdn_diag", "fla").state_dict()
    torch.manual_seed(0)
    plain = models.build_model(models.model_config("toy", "kdn_diag")).state_dict()
    assert all(torch.equal(plain[k], fla[k]) for k in fla)
    cfg = models.model_config("toy", "kdn_diag", init="authors")
    assert models.KDNConfig.from_dict(cfg.to_dict()).init == "authors"


def test_an_unknown_rule_is_refused() -> None:
    with pytest.raises(ValueError, match=r"init must be one of \['fla', 'authors'\].*'mamba'"):
        models.model_config("toy", "kdn_diag", init="mamba")
