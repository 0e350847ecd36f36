"""``KDNConfig``: the Hugging Face configuration of every backbone the paper trains."""
from __future__ import annotations

from typing import Any

from transformers import PretrainedConfig

from models.layers.attention import BACKENDS as ATTENTION_BACKENDS
from models.layers.attention import check_window
from models.registry import MIXERS

LAYER_CODES = {"R": "the configured mixer", "S": "sliding-window attention (config.window)", "A": "full attention"}
NAMED_PATTERNS = {"recurrent": "R", "hybrid_swa": "RS"}
INIT_RULES = ("fla", "authors")
"""Weight initialisation rules (``KDNConfig.init``; models/README.md, "Initialisation"): ``fla`` is fla's models'
(every linear, conv and embedding weight ``N(0, initializer_range)``), ``authors`` lit-gpt's ``mamba_init``, which
the authors' released configs set."""


def layer_pattern(pattern: str, num_layers: int) -> str:
    """Expand ``pattern`` into one code per layer (``R`` mixer, ``S`` sliding-window attention, ``A`` full attention).

    ``"recurrent"`` is every layer the mixer; ``"hybrid_swa"`` alternates mixer and SWA layers
    (``RSRS...``, 9 + 9 at 18 layers). Any other string of codes is repeated to ``num_layers`` and must
    divide it (``"RRRS"`` is a 3:1 hybrid).
    """
    if not isinstance(pattern, str) or not pattern:
        raise ValueError(f"pattern must be a non-empty string, got {pattern!r}")
    unit = NAMED_PATTERNS.get(pattern, pattern)
    bad = sorted(set(unit) - set(LAYER_CODES))
    if bad:
        raise ValueError(f"pattern {pattern!r} has unknown layer codes {bad}: use {sorted(NAMED_PATTERNS)} or a string "
                         f"of {LAYER_CODES}")
    if num_layers % len(unit):
        raise ValueError(f"pattern {pattern!r} (unit length {len(unit)}) does not divide num_layers={num_layers}")
    return unit * (num_layers // len(unit))


class KDNConfig(PretrainedConfig):
    """Configuration of :class:`models.KDNForCausalLM`.

    ``mixer`` names an entry of :data:`models.MIXERS` and ``mixer_kwargs`` the options of it that differ from its
    config's defaults (the fields of ``MIXERS[mixer].config``, e.g. ``{"mu": "1", "noise": "fixed_r"}`` for KDN,
    ``{"precision": "fp32"}``: docs/kernels.md, "Precision"). ``pattern`` chooses which layers use
    the mixer (see :func:`layer_pattern`); attention layers use ``num_heads x head_dim`` heads,
    RoPE base ``rope_theta`` and ``window``: the one window of every sliding layer and of ``mixer="attn"``
    (``None``: full attention; the sizes of :data:`models.sizes.SIZES` set it).
    ``intermediate_size`` is the SwiGLU width: one int for every layer, or a list of ``num_layers`` ints (parameter
    matching mixes two widths, both multiples of 16 or more, rather than use one width that tensor cores handle
    badly).

    Kernel settings (no effect on the parameters or the maths): ``fused`` runs the fused CUDA kernels of the front
    end, norms, SwiGLU and LM head (``False``: their PyTorch code on CUDA too); ``recompute_states`` makes the
    asymmetric memory's backward (KDN, KDA) recompute its WY terms and chunk states instead of keeping them (less
    memory, slower); ``attention_backend`` runs the attention layers' windows, documents, padding and cached prefixes
    through ``flex_attention``'s block masks on CUDA (``"auto"``) or SDPA's dense masks (``"sdpa"``; ``"flex"``: block
    masks on every device, forward only off CUDA). The mixers' own kernel settings are their options (Diagonal KDN's
    ``memory`` and ``chunk_size``, both KDNs' ``precision``: ``mixer.precision=fp32`` in training,
    ``kdn_diag/precision=fp32`` in ``eval.mqar``).

    ``init`` names the weight initialisation rule (:data:`INIT_RULES`): ``"fla"`` (the default) or ``"authors"``.
    """

    model_type = "kdn_lm"
    keys_to_ignore_at_inference = ["cache"]
    attribute_map = {"num_hidden_layers": "num_layers", "num_attention_heads": "num_heads"}

    def __init__(
        self,
        vocab_size: int = 32000,
        hidden_size: int = 2048,
        num_layers: int = 16,
        num_heads: int = 16,
        head_dim: int = 128,
        mixer: str = "kdn_diag",
        mixer_kwargs: dict[str, Any] | None = None,
        pattern: str = "recurrent",
        window: int | None = None,
        intermediate_size: int | list[int] = 5632,
        norm_eps: float = 1e-5,
        initializer_range: float = 0.02,
        tie_word_embeddings: bool = False,
        conv_size: int = 4,
        rope_theta: float = 10000.0,
        fuse_cross_entropy: bool = True,
        use_cache: bool = True,
        fused: bool = True,
        recompute_states: bool = False,
        attention_backend: str = "auto",
        init: str = "fla",
        pad_token_id: int | None = None,
        bos_token_id: int | None = 1,
        eos_token_id: int | None = 2,
        **kwargs: Any,
    ) -> None:
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.num_layers = num_layers
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.mixer = mixer
        self.mixer_kwargs = dict(mixer_kwargs or {}) if isinstance(mixer_kwargs, dict) or mixer_kwargs is None \
            else mixer_kwargs
        self.pattern = pattern
        self.window = window
        self.rope_theta = rope_theta
        self._adopt_attention_kwargs()
        self.intermediate_size = list(intermediate_size) if isinstance(intermediate_size, (list, tuple)) \
            else intermediate_size
        self.norm_eps = norm_eps
        self.initializer_range = initializer_range
        self.conv_size = conv_size
        self.fuse_cross_entropy = fuse_cross_entropy
        self.use_cache = use_cache
        self.fused = fused
        self.recompute_states = recompute_states
        self.attention_backend = attention_backend
        self.init = init
        self.check()
        super().__init__(pad_token_id=pad_token_id, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
                         tie_word_embeddings=tie_word_embeddings, **kwargs)

    @property
    def layer_codes(self) -> str:
        """One code per layer: ``R`` (mixer), ``S`` (sliding-window attention), ``A`` (full attention)."""
        return layer_pattern(self.pattern, self.num_layers)

    def _adopt_attention_kwargs(self) -> None:
        """Read the attention options that configs written before the window had one home kept in ``mixer_kwargs``
        (``mixer="attn"``: ``window``, ``rope_theta``) into the backbone's fields; refuse one that disagrees."""
        if self.mixer != "attn" or not isinstance(self.mixer_kwargs, dict):
            return
        for key in ("window", "rope_theta"):
            if key not in self.mixer_kwargs:
                continue
            value = self.mixer_kwargs.pop(key)
            sliding = key == "window" and "S" in NAMED_PATTERNS.get(self.pattern, self.pattern)
            if sliding and value != self.window:
                raise ValueError(f"mixer_kwargs[{key!r}]={value!r} differs from {key}={self.window!r} of this hybrid "
                                 f"config; one {key} serves every attention layer: set {key} alone")
            setattr(self, key, value)

    @property
    def mixer_options(self) -> Any:
        """The mixer's options as its config (``MIXERS[mixer].config``: ``mixer_kwargs`` over its defaults)."""
        return MIXERS[self.mixer].options(self.mixer_kwargs)

    def layer_mixer(self, layer_idx: int) -> tuple[str, dict[str, Any]]:
        """``(mixer name, kwargs)`` of layer ``layer_idx`` (an attention layer of the pattern takes none: its window
        is :meth:`layer_window`)."""
        return (self.mixer, self.mixer_kwargs) if self.layer_codes[layer_idx] == "R" else ("attn", {})

    def layer_window(self, layer_idx: int) -> int | None:
        """The attention window of layer ``layer_idx``: ``window`` for ``S`` layers and ``mixer="attn"``, ``None``
        (full) for ``A`` layers."""
        return None if self.layer_codes[layer_idx] == "A" else self.window

    def ffn_width(self, layer_idx: int) -> int:
        """The SwiGLU width of layer ``layer_idx``."""
        w = self.intermediate_size
        return w[layer_idx] if isinstance(w, list) else w

    def check(self) -> None:
        """Raise a ``ValueError`` that names the bad field and the fix."""
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads", "head_dim", "conv_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        widths = self.intermediate_size if isinstance(self.intermediate_size, list) else [self.intermediate_size]
        if isinstance(self.intermediate_size, list) and len(widths) != self.num_layers:
            raise ValueError(f"intermediate_size lists {len(widths)} widths for {self.num_layers} layers; give one int "
                             "or one width per layer")
        if any(isinstance(w, bool) or not isinstance(w, int) or w <= 0 for w in widths):
            raise ValueError(f"intermediate_size must be a positive int or a list of them, got "
                             f"{self.intermediate_size!r}")
        MIXERS.check_kwargs(self.mixer, self.mixer_kwargs)
        check_window(self.window)
        codes = layer_pattern(self.pattern, self.num_layers)
        has_attention = self.mixer == "attn" or any(c in "SA" for c in codes)
        if has_attention and self.num_heads * self.head_dim != self.hidden_size:
            raise ValueError(f"attention layers need num_heads * head_dim == hidden_size, got {self.num_heads} * "
                             f"{self.head_dim} = {self.num_heads * self.head_dim} != {self.hidden_size}")
        if "S" in codes and self.window is None:
            raise ValueError(f"pattern {self.pattern!r} has sliding-window layers: set window (tokens; the sizes of "
                             "models.sizes.SIZES give it)")
        for name in ("fused", "recompute_states"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {list(ATTENTION_BACKENDS)}, got "
                             f"{self.attention_backend!r}")
        if self.init not in INIT_RULES:
            raise ValueError(f"init must be one of {list(INIT_RULES)} (the weight initialisation rule), got "
                             f"{self.init!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"norm_eps must be > 0, got {self.norm_eps}")
