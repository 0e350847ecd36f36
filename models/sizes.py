"""Model sizes and parameter matching (docs/protocol.md §8).

Every model of a comparison uses the same backbone (layers, width, recurrent heads); the SwiGLU width
is solved so that its non-embedding parameter count is within ``TOLERANCE`` of the KDA model with the
same size and pattern, whose width follows fla's rule (``hidden_ratio = 4``: ``8 d / 3`` rounded up
to a multiple of 256). Counting builds the model on the meta device: no weight is allocated.
"""
from __future__ import annotations

import functools
import json
import math
from typing import Any

import torch

from models.configuration import KDNConfig
from models.registry import MIXERS

REFERENCE_MIXER = "kda"
TOLERANCE = 3e-4  # 0.03 %
WIDTH_MULTIPLES = (64, 32, 16)

SIZES: dict[str, dict[str, Any]] = {
    "toy": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32, "window": 16},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "head_dim": 64, "window": 256},
    "100m": {"hidden_size": 768, "num_layers": 12, "num_heads": 6, "head_dim": 128},
    "750m": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "head_dim": 128},
    "1.3b": {"hidden_size": 2304, "num_layers": 18, "num_heads": 18, "head_dim": 128},
}
"""Backbones: ``750m`` and ``1.3b`` are the paper's; ``100m`` a real GPU run; ``small`` a CPU demo;
``toy`` the tests. Mamba-3 at ``toy``/``small`` uses ``head_dim = 16``/``32`` (64 at the larger sizes)."""

MAMBA3_HEAD_DIM = {"toy": 16, "small": 32}


def reference_ffn_width(hidden_size: int) -> int:
    """fla's default SwiGLU width: ``int(8 d / 3)`` rounded up to a multiple of 256."""
    return 256 * math.ceil(int(hidden_size * 4 * 2 / 3) / 256)


def build_on_meta(cfg: KDNConfig) -> torch.nn.Module:
    """The model of ``cfg`` on the meta device (shapes only, no storage)."""
    from models.modeling import KDNForCausalLM

    with torch.device("meta"):
        return KDNForCausalLM(cfg)


def parameter_counts(cfg: KDNConfig) -> tuple[int, int]:
    """``(total, non-embedding)`` parameters; the embedding and an untied LM head are embeddings."""
    model = build_on_meta(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embeddings.weight.numel()
    if not cfg.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    return total, total - embedding


@functools.lru_cache(maxsize=64)
def _counts_cached(cfg_json: str) -> tuple[int, int]:
    return parameter_counts(KDNConfig.from_dict(json.loads(cfg_json)))


def _counts(cfg: KDNConfig) -> tuple[int, int]:
    return _counts_cached(cfg.to_json_string(use_diff=False))


def solve_ffn_width(cfg: KDNConfig, target: int, tolerance: float = TOLERANCE) -> int | list[int]:
    """The SwiGLU widths that bring ``cfg``'s non-embedding parameters within ``tolerance`` of ``target``.

    The count is affine in the widths (``3 d`` per unit of one layer's width). Widths that are multiples of 16 or
    more keep the FFN's bf16 GEMMs on aligned tensor-core paths; a width such as 5546 does not. So the largest
    multiple ``m`` in ``WIDTH_MULTIPLES`` wins for which the ``L`` layers, each of width ``a m`` or ``(a + 1) m``
    (the wider ones spread evenly), land within ``tolerance``. Returns one int when every layer gets the same
    width, else one width per layer; the nearest integer width for every layer when no multiple fits.
    """
    if isinstance(cfg.intermediate_size, list):
        raise ValueError("solve_ffn_width starts from one width for every layer, got a list")
    _, base = _counts(cfg)
    L, w0, per_unit = cfg.num_layers, cfg.intermediate_size, 3 * cfg.hidden_size
    exact = w0 + (target - base) / (per_unit * L)
    if exact < 1:
        raise ValueError(f"mixer {cfg.mixer!r} has {base - per_unit * L * w0} non-FFN parameters, "
                         f"more than the reference total {target}: no positive FFN width matches; use a larger size "
                         "or set intermediate_size explicitly")
    for m in WIDTH_MULTIPLES:
        low, extra = divmod(round(exact * L / m), L)
        if low < 1:
            continue
        widths = [(low + (i + 1) * extra // L - i * extra // L) * m for i in range(L)]
        if abs(base + (sum(widths) - L * w0) * per_unit - target) / target <= tolerance:
            return widths[0] if extra == 0 else widths
    return max(1, round(exact))


def model_config(
    size: str, mixer: str, pattern: str = "recurrent", vocab_size: int = 32000, **overrides: Any,
) -> KDNConfig:
    """The configuration of ``mixer`` at ``size`` (``toy``, ``small``, ``100m``, ``750m``, ``1.3b``).

    ``overrides`` set any :class:`KDNConfig` field; unless ``intermediate_size`` is among them, the FFN
    width is solved to match the KDA model of the same size, pattern and overrides.
    """
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known sizes: {', '.join(SIZES)}")
    fields = {**SIZES[size], "vocab_size": vocab_size, "pattern": pattern, **overrides}
    mixer_kwargs = dict(fields.pop("mixer_kwargs", {}) or {})
    if mixer.startswith("mamba3") and size in MAMBA3_HEAD_DIM:
        mixer_kwargs.setdefault("head_dim", MAMBA3_HEAD_DIM[size])
    fixed_width = "intermediate_size" in fields
    fields.setdefault("intermediate_size", reference_ffn_width(fields["hidden_size"]))
    cfg = KDNConfig(mixer=mixer, mixer_kwargs=mixer_kwargs, **fields)
    if fixed_width:
        return cfg
    reference = KDNConfig(mixer=REFERENCE_MIXER, **{**fields, "intermediate_size": reference_ffn_width(
        fields["hidden_size"])})
    cfg.intermediate_size = solve_ffn_width(cfg, _counts(reference)[1])
    return cfg


def build_model(cfg: KDNConfig) -> torch.nn.Module:
    """A freshly initialised :class:`models.KDNForCausalLM` for ``cfg``."""
    from models.modeling import KDNForCausalLM

    return KDNForCausalLM(cfg)


def recurrent_state_size(cfg: KDNConfig) -> int | None:
    """Recurrent memory per sequence, summed over layers, in elements (short-conv histories excluded);
    ``None`` when a full-attention layer makes it grow with the sequence."""
    total = 0
    for i in range(cfg.num_layers):
        name, kwargs = cfg.layer_mixer(i)
        size = MIXERS[name].state_size(cfg, kwargs)
        if size is None:
            return None
        total += size
    return total
