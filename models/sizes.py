"""Model sizes and parameter matching (docs/protocol.md §8).

Every model of a comparison uses the same backbone (layers, width, recurrent heads); the SwiGLU width is solved so
that the parameters of its block stack (every layer's mixer, FFN and two norms: no embedding, LM head or final
norm) land within ``TOLERANCE`` of a target. At the paper's sizes the target is :data:`MATCH_TARGETS`: at ``1.3b``
the block stacks of the authors' released GDN-2 configs, at ``750m`` our extension of them (see
:func:`derived_target`). At the other sizes, or with a backbone field overridden, it is the KDA model of the same
backbone and pattern whose width follows fla's rule (``8 d / 3`` rounded up to 256). Counting builds the model on
the meta device: no weight is allocated.
"""
from __future__ import annotations

import functools
import inspect
import json
import math
from dataclasses import dataclass
from typing import Any

import torch

from models.configuration import KDNConfig, layer_pattern
from models.registry import MIXERS

REFERENCE_MIXER = "kda"
TOLERANCE = 3e-4  # 0.03 %
WIDTH_MULTIPLES = (64, 32, 16)

SIZES: dict[str, dict[str, Any]] = {
    "toy": {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "head_dim": 32, "window": 16},
    "small": {"hidden_size": 256, "num_layers": 4, "num_heads": 4, "head_dim": 64, "window": 256},
    "100m": {"hidden_size": 768, "num_layers": 12, "num_heads": 6, "head_dim": 128, "window": 2048},
    "750m": {"hidden_size": 2048, "num_layers": 16, "num_heads": 16, "head_dim": 128, "window": 2048},
    "1.3b": {"hidden_size": 2304, "num_layers": 18, "num_heads": 18, "head_dim": 128, "window": 2048},
}
"""Backbones: ``750m`` and ``1.3b`` are the paper's; ``100m`` a real GPU run; ``small`` a CPU demo;
``toy`` the tests. ``window`` is the attention window of each size (sliding layers and ``mixer="attn"``): the one
default of the window (``backbone.window`` in training).
Mamba-3 at ``toy``/``small`` uses ``head_dim = 16``/``32`` (64 at the larger sizes)."""

MAMBA3_HEAD_DIM = {"toy": 16, "small": 32}

AUTHORS_SOURCE = "ngocbh/kalman-delta-networks, lit_gpt/config.py"
AUTHORS_WIDTH = 2304
"""``n_embd`` of every released config: 18 layers x 2304, 18 heads, vocabulary 32000, untied embeddings,
RMSNorm, LLaMA (SwiGLU) MLP, no biases outside the mixers."""


@dataclass(frozen=True)
class AuthorsConfig:
    """One released 1.3B config: its name, our mixer and pattern for it, SwiGLU width, block-stack parameters."""

    name: str
    mixer: str
    pattern: str
    ffn_width: int
    block_stack: int


AUTHORS_1_3B: tuple[AuthorsConfig, ...] = (
    AuthorsConfig("gdn2_1.3B", "gdn2", "recurrent", 6208, 1_302_638_112),
    AuthorsConfig("iso_kdn_1.3B", "kdn_iso", "recurrent", 7208, 1_302_390_288),
    AuthorsConfig("diag_kdn_1.3B", "kdn_diag", "recurrent", 7128, 1_302_348_492),
    AuthorsConfig("swa_gdn2_1.3B", "gdn2", "hybrid_swa", 6784, 1_300_314_384),
)
"""The configs of :data:`AUTHORS_SOURCE` with their block-stack counts (``transformer.h``; the file's comments
give them, and for the KDN configs also the totals 1,449,848,592 and 1,449,806,796)."""

GDN2_AUTHORS_LAYOUT: dict[str, Any] = {"num_heads": 16, "output_gate": "swish_low_rank"}
"""``gdn2`` mixer_kwargs that give the authors' GDN-2 layer. Their block builds ``GatedDeltaNet2(hidden_size)`` at
its defaults, 16 heads x 128 (``expand_v = 1``) whatever the width, with a swish-gated output norm; its
projections are fla's ``GatedDeltaNet2``'s. At 2304 wide that is 29,454,480 parameters against 33,062,546 with
the backbone's 18 heads."""


@dataclass(frozen=True)
class Target:
    """A matching target: block-stack parameters and where the number comes from."""

    block_stack: int
    source: str


_OUR_RULE = "our choice (the authors released no 750M config): the authors' GDN-2 at 16 x 2048, "


MATCH_TARGETS: dict[tuple[str, str], Target] = {
    ("1.3b", "recurrent"): Target(1_302_638_112, f"gdn2_1.3B's block stack, {AUTHORS_SOURCE}"),
    ("1.3b", "hybrid_swa"): Target(1_300_314_384, f"swa_gdn2_1.3B's block stack, {AUTHORS_SOURCE}"),
    ("750m", "recurrent"): Target(961_022_208, _OUR_RULE + "SwiGLU width 5504 = 2048 x 6208 / 2304 rounded to 64"),
    ("750m", "hybrid_swa"): Target(960_791_680, _OUR_RULE + "alternating with 2K sliding-window attention, SwiGLU "
                                                "width 6272: the multiple of 64 nearest the recurrent count"),
}
"""The matching target of each paper size and pattern (``(size, "recurrent" | "hybrid_swa")``); any other
pattern at these sizes matches the size's ``recurrent`` target. Every entry equals :func:`derived_target`, whose
rule reproduces the released counts at ``1.3b`` exactly."""

BACKBONE_FIELDS = ("hidden_size", "num_layers", "num_heads", "head_dim", "conv_size")


def reference_ffn_width(hidden_size: int) -> int:
    """fla's default SwiGLU width: ``int(8 d / 3)`` rounded up to a multiple of 256."""
    return 256 * math.ceil(int(hidden_size * 4 * 2 / 3) / 256)


def build_on_meta(cfg: KDNConfig) -> torch.nn.Module:
    """The model of ``cfg`` on the meta device (shapes only, no storage)."""
    from models.modeling import KDNForCausalLM

    with torch.device("meta"):
        return KDNForCausalLM(cfg)


def _all_counts(cfg: KDNConfig) -> tuple[int, int, int]:
    """``(total, non-embedding, block stack)`` parameters of ``cfg``'s model."""
    model = build_on_meta(cfg)
    total = sum(p.numel() for p in model.parameters())
    embedding = model.model.embeddings.weight.numel()
    if not cfg.tie_word_embeddings:
        embedding += model.lm_head.weight.numel()
    return total, total - embedding, sum(p.numel() for p in model.model.layers.parameters())


@functools.lru_cache(maxsize=128)
def _counts_cached(cfg_json: str) -> tuple[int, int, int]:
    return _all_counts(KDNConfig.from_dict(json.loads(cfg_json)))


def _counts(cfg: KDNConfig) -> tuple[int, int, int]:
    return _counts_cached(cfg.to_json_string(use_diff=False))


def parameter_counts(cfg: KDNConfig) -> tuple[int, int]:
    """``(total, non-embedding)`` parameters; the embedding and an untied LM head are embeddings."""
    return _counts(cfg)[:2]


def block_stack_parameters(cfg: KDNConfig) -> int:
    """Parameters of the blocks alone (mixers, FFNs and their norms), what the matching targets count."""
    return _counts(cfg)[2]


def solve_ffn_width(cfg: KDNConfig, target: int, tolerance: float = TOLERANCE) -> int | list[int]:
    """The SwiGLU widths that bring ``cfg``'s block-stack parameters within ``tolerance`` of ``target``.

    The count is affine in the widths (``3 d`` per unit of one layer's width). Widths that are multiples of 16 or
    more keep the FFN's bf16 GEMMs on aligned tensor-core paths; a width such as 5546 does not. So the largest
    multiple ``m`` in ``WIDTH_MULTIPLES`` wins for which the ``L`` layers, each of width ``a m`` or ``(a + 1) m``
    (the wider ones spread evenly), land within ``tolerance``. Returns one int when every layer gets the same
    width, else one width per layer; the nearest integer width for every layer when no multiple fits.
    """
    if isinstance(cfg.intermediate_size, list):
        raise ValueError("solve_ffn_width starts from one width for every layer, got a list")
    base = block_stack_parameters(cfg)
    L, w0, per_unit = cfg.num_layers, cfg.intermediate_size, 3 * cfg.hidden_size
    exact = w0 + (target - base) / (per_unit * L)
    if exact < 1:
        raise ValueError(f"mixer {cfg.mixer!r} has {base - per_unit * L * w0} parameters outside its FFNs, more than "
                         f"the target {target}: no positive FFN width matches; use a larger size or set "
                         "intermediate_size explicitly")
    for m in WIDTH_MULTIPLES:
        low, extra = divmod(round(exact * L / m), L)
        if low < 1:
            continue
        widths = [(low + (i + 1) * extra // L - i * extra // L) * m for i in range(L)]
        if abs(base + (sum(widths) - L * w0) * per_unit - target) / target <= tolerance:
            return widths[0] if extra == 0 else widths
    return max(1, round(exact))


def paper_pattern(pattern: str, num_layers: int) -> str | None:
    """The named layout (``"recurrent"``, ``"hybrid_swa"``) that ``pattern`` expands to over ``num_layers``, or
    ``None``."""
    codes = layer_pattern(pattern, num_layers)
    return next((name for name in ("recurrent", "hybrid_swa") if codes == layer_pattern(name, num_layers)), None)


def _config_default(name: str) -> Any:
    return inspect.signature(KDNConfig.__init__).parameters[name].default


def _fields(size: str, pattern: str, vocab_size: int, overrides: dict[str, Any]) -> dict[str, Any]:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; known sizes: {', '.join(SIZES)}")
    return {**SIZES[size], "vocab_size": vocab_size, "pattern": pattern, **overrides}


def _target(size: str, fields: dict[str, Any]) -> Target:
    same_backbone = all(fields.get(k, _config_default(k)) == SIZES[size].get(k, _config_default(k))
                        for k in BACKBONE_FIELDS)
    if same_backbone and (size, "recurrent") in MATCH_TARGETS:
        key = (size, paper_pattern(fields["pattern"], fields["num_layers"]))
        return MATCH_TARGETS.get(key, MATCH_TARGETS[(size, "recurrent")])
    fields = {k: v for k, v in fields.items() if k not in ("mixer_kwargs", "intermediate_size")}
    width = reference_ffn_width(fields["hidden_size"])
    reference = KDNConfig(mixer=REFERENCE_MIXER, intermediate_size=width, **fields)
    return Target(block_stack_parameters(reference), f"KDA at this backbone with fla's SwiGLU width rule, {width}")


def match_target(size: str, pattern: str = "recurrent", vocab_size: int = 32000, **overrides: Any) -> Target:
    """The block-stack target that :func:`model_config` matches for ``size``, ``pattern`` and ``overrides``."""
    return _target(size, _fields(size, pattern, vocab_size, overrides))


def _authors_gdn2_stack(size: str, pattern: str, width: int) -> int:
    return block_stack_parameters(model_config(size, "gdn2", pattern, mixer_kwargs=GDN2_AUTHORS_LAYOUT,
                                               intermediate_size=width))


def derived_target(size: str, pattern: str = "recurrent") -> tuple[int, int]:
    """``(block-stack parameters, SwiGLU width)`` of the authors' GDN-2 model (:data:`GDN2_AUTHORS_LAYOUT`) at
    ``size``'s backbone: the rule behind :data:`MATCH_TARGETS`.

    ``recurrent``: the width is ``d x 6208 / 2304`` (gdn2_1.3B's ratio) rounded to a multiple of 64.
    ``hybrid_swa``: GDN-2 and sliding-window attention alternating, at the multiple of 64 that brings the count
    nearest the recurrent one (how swa_gdn2_1.3B's 6784 relates to gdn2_1.3B's count).
    """
    if pattern not in ("recurrent", "hybrid_swa"):
        raise ValueError(f"pattern must be 'recurrent' or 'hybrid_swa', got {pattern!r}")
    d, L = SIZES[size]["hidden_size"], SIZES[size]["num_layers"]
    gdn2_ratio = next(c.ffn_width for c in AUTHORS_1_3B if c.name == "gdn2_1.3B") / AUTHORS_WIDTH
    width = 64 * round(d * gdn2_ratio / 64)
    recurrent = _authors_gdn2_stack(size, "recurrent", width)
    if pattern == "recurrent":
        return recurrent, width
    width += 64 * round((recurrent - _authors_gdn2_stack(size, pattern, width)) / (3 * d * L * 64))
    return _authors_gdn2_stack(size, pattern, width), width


def model_config(
    size: str, mixer: str, pattern: str = "recurrent", vocab_size: int = 32000, **overrides: Any,
) -> KDNConfig:
    """The configuration of ``mixer`` at ``size`` (``toy``, ``small``, ``100m``, ``750m``, ``1.3b``).

    ``overrides`` set any :class:`KDNConfig` field; unless ``intermediate_size`` is among them, the FFN
    width is solved to match :func:`match_target` of the same size, pattern and overrides.
    """
    fields = _fields(size, pattern, vocab_size, overrides)
    mixer_kwargs = dict(fields.pop("mixer_kwargs", {}) or {})
    if mixer.startswith("mamba3") and size in MAMBA3_HEAD_DIM:
        mixer_kwargs.setdefault("head_dim", MAMBA3_HEAD_DIM[size])
    fixed_width = "intermediate_size" in fields
    fields.setdefault("intermediate_size", reference_ffn_width(fields["hidden_size"]))
    cfg = KDNConfig(mixer=mixer, mixer_kwargs=mixer_kwargs, **fields)
    if not fixed_width:
        cfg.intermediate_size = solve_ffn_width(cfg, _target(size, fields).block_stack)
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
        size = MIXERS[name].state_size(cfg, i, kwargs)
        if size is None:
            return None
        total += size
    return total
