"""The mixer registry: every token mixer the paper trains, keyed by name.

``MIXERS[name]`` is a :class:`MixerSpec`; an unknown name raises a ``ValueError`` that lists the
known ones. ``spec.config`` is the mixer's options dataclass (its fields are the ``mixer_kwargs`` it takes and the
``mixer.<field>`` keys of training; KDN's sit beside its layer, :mod:`kdn.layers.kdn`);
``spec.build(config, layer_idx, kwargs)`` makes the module (``kwargs`` being the
config's ``mixer_kwargs``; attention layers of a hybrid pattern take the backbone's window; the config's ``fused`` and
``recompute_states`` reach every mixer that reads them);
``spec.state_size(config, layer_idx, kwargs)`` is the recurrent memory per sequence and layer, in elements
(``None`` for full attention, whose cache grows with the sequence); ``spec.residual_out`` names the output
projection that the ``authors`` initialisation rescales (see :class:`MixerSpec`).
"""
from __future__ import annotations

import difflib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields, is_dataclass, make_dataclass
from typing import Any

import torch.nn as nn

import kdn
from models.layers.attention import Attention, AttentionConfig
from models.layers.delta import DELTA_MIXERS
from models.layers.mamba3 import Mamba3


@dataclass(frozen=True)
class MixerSpec:
    """How to build one kind of mixer and how much recurrent state it carries.

    ``residual_out``: the attribute of the mixer's output projection that lit-gpt's ``mamba_init`` rescales by
    ``1 / sqrt(2 num_layers)`` (its rule matches the names ``out_proj``, attention's ``proj`` and the FFN's ``w3``):
    attention's ``o_proj`` and Mamba-3's ``out_proj``; ``None`` for the delta mixers, whose ``o_proj`` the rule
    leaves at PyTorch's default, as in the authors' KDN and GDN-2 layers. ``kdn``: one of the paper's Kalman mixers
    (:data:`KDN_MIXERS`)."""

    name: str
    config: type
    build: Callable[[Any, int, dict], nn.Module]
    state_size: Callable[[Any, dict], int | None]
    residual_out: str | None = None
    kdn: bool = False

    @property
    def kwargs(self) -> tuple[str, ...]:
        """The options this mixer takes: the fields of :attr:`config`."""
        return tuple(f.name for f in fields(self.config))

    def options(self, kwargs: dict) -> Any:
        """``kwargs`` as this mixer's :attr:`config` (its defaults filled, its fields checked)."""
        return self.config(**kwargs)


class MixerRegistry(dict):
    """A ``dict`` of :class:`MixerSpec` whose missing keys raise a ``ValueError`` naming the known mixers."""

    def __missing__(self, name: object) -> MixerSpec:
        raise ValueError(f"unknown mixer {name!r}; known mixers: {', '.join(sorted(self))}")

    def register(self, spec: MixerSpec) -> MixerSpec:
        """Add ``spec`` under its name (a name taken already is a ``ValueError``); returns it."""
        if spec.name in self:
            raise ValueError(f"mixer {spec.name!r} is registered already; pick another name")
        if not is_dataclass(spec.config):
            raise ValueError(f"mixer {spec.name!r}: config must be a dataclass of its options, got {spec.config!r}")
        self[spec.name] = spec
        return spec

    def taking(self, option: str) -> list[str]:
        """The mixers whose config has the field ``option``."""
        return sorted(n for n, s in self.items() if option in s.kwargs)

    def check_kwargs(self, name: str, kwargs: dict) -> None:
        """Raise a one-line ``ValueError`` for a mixer keyword that ``name`` does not take (naming the mixers that take
        it, or the closest of its own) or a value its config refuses."""
        spec = self[name]
        if not isinstance(kwargs, dict):
            raise ValueError(f"mixer_kwargs must be a dict, got {type(kwargs).__name__}")
        for key in sorted(kwargs):
            if key not in spec.kwargs:
                raise ValueError(unknown_option(name, key))
        spec.options(kwargs)


def unknown_option(mixer: str, key: str) -> str:
    """The one line for an option ``key`` that ``mixer`` does not take: the mixers that take it, or the closest of
    ``mixer``'s own options."""
    spec = MIXERS[mixer]
    others = MIXERS.taking(key)
    if others:
        return f"mixer {mixer!r} does not take {key!r}; the mixers taking it: {', '.join(others)}"
    close = difflib.get_close_matches(key, spec.kwargs, n=1)
    return f"mixer {mixer!r} does not take {key!r}" + (f" (did you mean {close[0]!r}?)" if close else
                                                       f"; its options: {', '.join(spec.kwargs) or 'none'}")


BACKBONE_ARGS = ("self", "hidden_size", "num_heads", "head_dim", "conv_size", "norm_eps", "layer_idx", "fused",
                 "recompute_states")
"""Constructor arguments that the backbone sets (from ``KDNConfig``), not the mixer's options."""


def options_of(layer: Callable[..., Any], doc: str, backbone: tuple[str, ...] = BACKBONE_ARGS, **unset: Any) -> type:
    """A dataclass of ``layer``'s own keyword arguments (its signature's, less the ``backbone`` ones), with their
    defaults there (declared once; ``unset`` names those the registry derives when not given): a new argument of the
    layer is a new option. The layer checks their values when it is built."""
    params = inspect.signature(layer).parameters
    names = [n for n, p in params.items() if n not in backbone and p.kind in (p.KEYWORD_ONLY,
                                                                              p.POSITIONAL_OR_KEYWORD)]
    defaults = {n: unset[n] if n in unset else params[n].default for n in names}
    return make_dataclass(f"{layer.__qualname__.split('.')[0]}Options",
                          [(n, Any, field(default=defaults[n])) for n in names], namespace={"__doc__": doc})


def _matrix_state(cfg: Any, kwargs: dict) -> int:
    return cfg.num_heads * cfg.head_dim * cfg.head_dim


def _kdn(isotropic: bool) -> MixerSpec:
    cls = kdn.IsotropicKDN if isotropic else kdn.DiagonalKDN

    def build(cfg: Any, idx: int, kw: dict) -> nn.Module:
        layer = cls(cfg.hidden_size, cfg.num_heads, cfg.head_dim, conv_size=cfg.conv_size, norm_eps=cfg.norm_eps,
                    layer_idx=idx, fused=cfg.fused, recompute_states=cfg.recompute_states, **kw)
        if hasattr(layer, "omega_proj"):
            # the zero-initialised process noise (docs/math.md §5) survives the named weight-init rules: both for
            # Diagonal KDN's last stage, fla's alone for Isotropic KDN's projection, whose weight the authors' rule
            # draws like any linear's (their layer zeroes only its bias)
            last = layer.omega_proj if isotropic else layer.omega_proj[-1]
            last._keep_init = ("fla",) if isotropic else ("fla", "authors")
        return layer

    def state(cfg: Any, idx: int, kw: dict) -> int:
        return _matrix_state(cfg, kw) + cfg.num_heads * (1 if isotropic else cfg.head_dim)

    return MixerSpec(f"kdn_{'iso' if isotropic else 'diag'}", cls.Config, build, state, kdn=True)


def mixer_heads(cfg: Any, kw: dict) -> int:
    """A delta mixer's heads: ``kw["num_heads"]`` when given (GDN-2 only), else the backbone's ``num_heads``."""
    heads = kw.get("num_heads", cfg.num_heads)
    if isinstance(heads, bool) or not isinstance(heads, int) or heads <= 0:
        raise ValueError(f"mixer_kwargs['num_heads'] must be a positive int, got {heads!r}")
    return heads


def _delta(name: str) -> MixerSpec:
    cls = DELTA_MIXERS[name]
    options = options_of(_delta_init(cls),
                         f"{cls.__name__}'s options (its layer checks them)")
    if name == "gdn2":  # GDN-2 may keep its own head count: the authors' GDN-2 is fla's layer at 16 heads at any width
        options = make_dataclass("GDN2Options", [("num_heads", Any, field(default=None))], bases=(options,),
                                 namespace={"__doc__": "GDN-2's options: num_heads (None: the backbone's)"})

    def build(cfg: Any, idx: int, kw: dict) -> nn.Module:
        heads = mixer_heads(cfg, kw)
        kw = {k: v for k, v in kw.items() if k != "num_heads"}
        return cls(cfg.hidden_size, heads, cfg.head_dim, conv_size=cfg.conv_size, norm_eps=cfg.norm_eps,
                   layer_idx=idx, fused=cfg.fused, recompute_states=cfg.recompute_states, **kw)

    def state(cfg: Any, idx: int, kw: dict) -> int:
        return mixer_heads(cfg, kw) * cfg.head_dim * cfg.head_dim

    return MixerSpec(name, options, build, state)


def _delta_init(cls: type) -> Callable[..., Any]:
    """The constructor that declares a delta mixer's keyword defaults (:class:`models.layers.delta._DeltaRule`)."""
    return next(c.__init__ for c in cls.__mro__ if "output_gate" in inspect.signature(c.__init__).parameters)



def mamba3_state_size(cfg: Any, kw: dict) -> int:
    """The Mamba-3 ``state_size`` N: given, or chosen so that ``heads x head_dim x N`` equals KDA's ``H K V``."""
    if "state_size" in kw:
        return int(kw["state_size"])
    inner = int(kw.get("expand", 2) * cfg.hidden_size)
    target = _matrix_state(cfg, kw)
    if target % inner or target // inner < 2:
        raise ValueError(f"cannot match Mamba-3's state to num_heads*head_dim^2 = {target} with expand*hidden_size = "
                         f"{inner}; set mixer_kwargs['state_size'] explicitly")
    return target // inner


def _mamba3(mimo: bool) -> MixerSpec:
    def build(cfg: Any, idx: int, kw: dict) -> nn.Module:
        kw = {**kw, "state_size": mamba3_state_size(cfg, kw)}
        if not mimo and "mimo_rank" in kw:
            raise ValueError("mimo_rank applies to mamba3_mimo only")
        return Mamba3(cfg.hidden_size, is_mimo=mimo, norm_eps=cfg.norm_eps, layer_idx=idx, fused=cfg.fused, **kw)

    def state(cfg: Any, idx: int, kw: dict) -> int:
        inner = int(kw.get("expand", 2) * cfg.hidden_size)
        return inner * mamba3_state_size(cfg, kw)

    options = options_of(Mamba3.__init__, backbone=("self", "hidden_size", "norm_eps", "layer_idx", "fused", "is_mimo"),
                         doc="Mamba-3's options (its layer checks them); state_size None: matched to KDA's memory",
                         state_size=None)
    return MixerSpec(f"mamba3_{'mimo' if mimo else 'siso'}", options, build, state, "out_proj")


def _attn() -> MixerSpec:
    def build(cfg: Any, idx: int, kw: dict) -> nn.Module:
        return Attention(cfg.hidden_size, cfg.num_heads, cfg.head_dim, window=cfg.layer_window(idx),
                         rope_theta=cfg.rope_theta, layer_idx=idx, backend=getattr(cfg, "attention_backend", "auto"))

    def state(cfg: Any, idx: int, kw: dict) -> int | None:
        w = cfg.layer_window(idx)
        return None if w is None else 2 * (w - 1) * cfg.num_heads * cfg.head_dim

    return MixerSpec("attn", AttentionConfig, build, state, "o_proj")


MIXERS: MixerRegistry = MixerRegistry({
    "kdn_diag": _kdn(False),  # Diagonal KDN (ours)
    "kdn_iso": _kdn(True),  # Isotropic KDN (ours)
    "deltanet": _delta("deltanet"),  # fla DeltaNet
    "gdn": _delta("gdn"),  # fla GatedDeltaNet
    "kda": _delta("kda"),  # fla KimiDeltaAttention
    "gdn2": _delta("gdn2"),  # fla GatedDeltaNet2 (num_heads, output_gate="swish_low_rank": the authors' GDN-2)
    "mamba3_siso": _mamba3(False),  # fla Mamba3, SISO
    "mamba3_mimo": _mamba3(True),  # fla Mamba3, MIMO (mimo_rank, default 4)
    "attn": _attn(),  # softmax attention with RoPE: sliding (the backbone's window) or full (window None)
})

KDN_MIXERS: tuple[str, ...] = tuple(name for name, spec in MIXERS.items() if spec.kdn)
"""The paper's Kalman mixers, the ones taking KDN's options (mu, noise, alpha_param, precision...)."""
