"""What the KDN layers hand the memory's API: the layer's ``precision`` (and its other kernel settings) on every
path of ``forward`` that runs the chunked memory, so that a layer built with ``precision="fp32"`` runs the FP32
route on CUDA (``tests/test_kdn_precision_gpu.py`` measures that route through the layer). The one-token decoding
steps take no precision: they compute in FP32 whatever their inputs (``kdn.ops.api._step``, the fused step's
kernel)."""
from __future__ import annotations

from typing import Any

import pytest
import torch

import kdn
from kdn.ops import api

D, H, K = 32, 2, 16
LAYERS = [kdn.DiagonalKDN, kdn.IsotropicKDN]
PATHS = ("plain", "padded", "beta_eff", "packed", "prefill", "cached_chunk", "decoding")


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every call of the memory's API functions that the layers call: ``(name, keyword arguments)``; each call
    goes on to the real function."""
    seen: list[tuple[str, dict[str, Any]]] = []
    for name in ("diagonal_kdn", "isotropic_kdn", "diagonal_kdn_step", "isotropic_kdn_step"):
        real = getattr(api, name)

        def spy(*args: Any, _real: Any = real, _name: str = name, **kwargs: Any) -> Any:
            seen.append((_name, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(api, name, spy)
    return seen


def run_path(layer: torch.nn.Module, path: str) -> None:
    """One forward of ``layer`` along ``path`` (``cached_chunk`` and ``decoding``: after a prefill)."""
    torch.manual_seed(1)
    x = torch.randn(2, 12, D)
    with torch.no_grad():
        if path == "plain":
            layer(x)
        elif path == "padded":
            mask = torch.ones(2, 12, dtype=torch.long)
            mask[1, :5] = 0
            layer(x, attention_mask=mask)
        elif path == "beta_eff":
            layer(x, output_beta_eff=True)
        elif path == "packed":
            layer(x[:1], cu_seqlens=torch.tensor([0, 5, 12]))
        elif path == "prefill":
            layer(x, use_cache=True)
        else:  # a prefill, then a chunk of five tokens or one token with the cache
            _, _, cache = layer(x[:, :7], use_cache=True)
            layer(x[:, 7:] if path == "cached_chunk" else x[:, 7:8], past_key_values=cache, use_cache=True)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("fused", [True, False], ids=["fused", "unfused"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("cls", LAYERS, ids=["diagonal", "isotropic"])
def test_the_layer_hands_its_precision_to_the_memory_on_every_path(
        cls: type, precision: str, fused: bool, path: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    """Every chunked-memory call of the layer gets its ``precision`` and ``recompute_states`` (Diagonal KDN: its
    ``memory`` and ``chunk_size`` too), with or without the fused front end, padded, packed, with ``beta_eff``,
    filling a cache or continuing one; a one-token decoding step goes to the step, which takes none."""
    layer = cls(D, H, K, layer_idx=0, fused=fused, precision=precision, recompute_states=True).eval()
    run_path(layer, path)
    chunk = "isotropic_kdn" if cls is kdn.IsotropicKDN else "diagonal_kdn"
    want = {"precision": precision, "recompute_states": True}
    if cls is kdn.DiagonalKDN:
        want |= {"memory": "asym", "chunk_size": None}
    made = [kw for name, kw in calls if name == chunk]
    assert made, f"no call of api.{chunk}: {[name for name, _ in calls]}"
    for kw in made:
        assert {k: kw.get(k) for k in want} == want, kw
    # with the fused front end KDA's gate goes to the kernels, except padded and beta_eff (applied before them)
    gated = [kw["gate"] is not None for kw in made]
    assert gated == [fused and path not in ("padded", "beta_eff")] * len(made)
    steps = [name for name, _ in calls if name.endswith("_step")]
    assert steps == ([f"{chunk}_step"] if path == "decoding" else [])
