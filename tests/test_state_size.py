"""A model's reported recurrent state (``models.recurrent_state_size``, what the MQAR table and the size table print)
equals what its layers hold in the decoding cache after a forward, for every mixer and pattern: the memory proper,
not the short-conv histories, Mamba-3's previous-step inputs or attention's position bookkeeping."""
from __future__ import annotations

import warnings

import pytest
import torch
from torch import Tensor

from models import MIXERS, build_model, model_config, recurrent_state_size

warnings.filterwarnings("ignore", message=".*Triton is not supported.*")

V, B = 64, 2


def memory(mixer: str, state: dict) -> list[Tensor]:
    """The tensors of one layer's cache that are its recurrent memory."""
    if mixer == "attn":
        return [state["k"], state["v"]]  # at most window - 1 keys and values
    recurrent = state["recurrent"]
    if mixer.startswith("mamba3"):
        return [recurrent[1]]  # the SSM state; the others are the previous step's angle, B and x
    return list(recurrent) if isinstance(recurrent, (tuple, list)) else [recurrent]  # KDN: memory and precisions


def held(model: torch.nn.Module, tokens: int) -> int:
    """Elements of recurrent memory per sequence over every layer after a forward of ``tokens`` tokens."""
    cfg = model.config
    ids = torch.randint(0, V, (B, tokens), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        cache = model(ids, use_cache=True).recurrent_cache
    total = 0
    for i in range(cfg.num_layers):
        for t in memory(cfg.layer_mixer(i)[0], cache.layers[i]):
            assert t.shape[0] == B
            total += t[0].numel()
    return total


@pytest.mark.parametrize("pattern", ["recurrent", "hybrid_swa"])
@pytest.mark.parametrize("mixer", sorted(MIXERS))
def test_reported_state_equals_the_cache(mixer: str, pattern: str) -> None:
    torch.manual_seed(0)
    cfg = model_config("toy", mixer, pattern, vocab_size=V)
    model = build_model(cfg).eval()
    reported = recurrent_state_size(cfg)
    assert reported is not None and reported > 0
    assert held(model, cfg.window + 4) == reported  # past the window: every ring is full
    assert held(model, 2 * cfg.window + 3) == reported  # and stays so: constant memory


def test_full_attention_reports_no_fixed_state_and_its_cache_grows() -> None:
    cfg = model_config("toy", "kda", "RA", vocab_size=V)
    model = build_model(cfg).eval()
    assert recurrent_state_size(cfg) is None
    ids = torch.randint(0, V, (1, 30))
    with torch.no_grad():
        short = model(ids[:, :10], use_cache=True).recurrent_cache.layers[1]["k"].shape[-2]
        long = model(ids, use_cache=True).recurrent_cache.layers[1]["k"].shape[-2]
    assert (short, long) == (10, 30)
