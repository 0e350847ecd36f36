"""``KDNForCausalLM``: embedding, pre-norm blocks (mixer + SwiGLU), final norm, LM head.

Block: ``h = h + mixer(RMSNorm(h)); h = h + SwiGLU(RMSNorm(h))``, with the stream ``h`` in FP32 and each add
inside the blocks fused into the norm after it. Registered with ``AutoConfig``
and ``AutoModelForCausalLM`` (``model_type = "kdn_lm"``) when :mod:`models` is imported, so
``AutoModelForCausalLM.from_pretrained(path)`` needs no ``trust_remote_code``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutputWithPast

from kdn.modules import Linear, fla_fused, linear, stacked_weights
from models.cache import KDNCache
from models.configuration import KDNConfig
from models.layers.common import RMSNorm, check_cu_seqlens
from models.layers.lm_head import LMHead
from models.registry import MIXERS

AUTHORS_EMBEDDING_STD = 0.02
"""The embedding's standard deviation under ``init="authors"`` (lit-gpt's ``mamba_init``), whatever
``initializer_range`` says."""

# transformers renamed the output's cache field (``past_key_values`` in 5.17, ``cache`` by 5.24)
CACHE_FIELD = "cache" if "cache" in {f.name for f in fields(CausalLMOutputWithPast)} else "past_key_values"


@dataclass
class KDNCausalLMOutput(CausalLMOutputWithPast):
    """``CausalLMOutputWithPast`` plus ``beta_eff``: per layer ``[B, T, H]`` (``None`` for layers without one)."""

    beta_eff: tuple[Tensor | None, ...] | None = None

    @property
    def recurrent_cache(self) -> KDNCache | None:
        """The decoding cache, whichever name the installed transformers gives the field."""
        return getattr(self, CACHE_FIELD)


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``, ``x [..., d]``; ``3 d w`` parameters for width ``w``.

    The gate and up projections run as one GEMM over their stacked weights (``[..., 2w]``), and on CUDA the
    activation reads that joint output and writes its gradient as one tensor (:func:`kdn.modules.swiglu.swiglu_joint`):
    the input's gradient is one GEMM, with no add of two and no ``cat`` of split gradients. ``fused=False``: the
    PyTorch activation on every device."""

    def __init__(self, hidden_size: int, intermediate_size: int, *, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.gate_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        ws = [self.gate_proj.weight, self.up_proj.weight]
        decoding = x.shape[-2] == 1 and not torch.is_grad_enabled()  # one token a row: keep the stack between steps
        y = linear(x, stacked_weights(self, ws, x) if decoding else ws)
        if fla_fused(y, self.fused):
            from kdn.modules.swiglu import swiglu_joint

            return self.down_proj(swiglu_joint(y))
        gate, up = y.chunk(2, -1)
        return self.down_proj(F.silu(gate) * up)


class KDNBlock(GradientCheckpointingLayer):
    """Pre-norm residual block: mixer then SwiGLU FFN, carrying the residual stream apart from the sublayer
    outputs (as fla and Mamba do) so that each add and the norm after it are one fused pass."""

    def __init__(self, config: KDNConfig, layer_idx: int) -> None:
        super().__init__()
        name, kwargs = config.layer_mixer(layer_idx)
        self.mixer_norm = RMSNorm(config.hidden_size, config.norm_eps, fused=config.fused)
        spec = MIXERS[name]
        self.mixer = spec.build(config, layer_idx, kwargs)
        self.mlp_norm = RMSNorm(config.hidden_size, config.norm_eps, fused=config.fused)
        self.mlp = SwiGLU(config.hidden_size, config.ffn_width(layer_idx), fused=config.fused)
        # the projections that write into the residual stream and that init="authors" rescales
        self.mlp.down_proj._residual_out = True
        if spec.residual_out is not None:
            getattr(self.mixer, spec.residual_out)._residual_out = True

    def forward(
        self, hidden_states: Tensor, residual: Tensor | None = None, attention_mask: Tensor | None = None,
        cache: KDNCache | None = None, use_cache: bool = False, cu_seqlens: Tensor | None = None,
        output_beta_eff: bool = False,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """``hidden_states [B, T, d]``: the previous sublayer's output (the embeddings for the first block);
        ``residual [B, T, d]``: the stream before it (``None`` for the first block). Returns this block's FFN
        output, the stream before it (their sum is the block's output) and ``beta_eff``."""
        x, residual = self.mixer_norm.add_norm(hidden_states, residual)
        o, beta_eff, _ = self.mixer(x, attention_mask=attention_mask, past_key_values=cache, use_cache=use_cache,
                                    cu_seqlens=cu_seqlens, output_beta_eff=output_beta_eff)
        x, residual = self.mlp_norm.add_norm(o, residual)
        return self.mlp(x), residual, beta_eff


class KDNPreTrainedModel(PreTrainedModel):
    """Weight initialisation (``config.init``: fla's rule or the authors') and HF plumbing shared by the KDN
    models."""

    config_class = KDNConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["KDNBlock"]
    _is_stateful = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        """``init="fla"``: ``N(0, initializer_range)`` for linear, conv and embedding weights, zero biases.
        ``init="authors"``: :meth:`_init_authors`. Under both, mixer-specific parameters keep their constructor
        initialisation, as do the modules whose ``_keep_init`` names the rule."""
        if self.config.init in getattr(module, "_keep_init", ()):
            return
        if self.config.init == "authors":
            self._init_authors(module)
            return
        std = self.config.initializer_range
        if isinstance(module, (nn.Linear, nn.Conv1d)):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)

    def _init_authors(self, module: nn.Module) -> None:
        """lit-gpt's ``mamba_init``, as the authors' configs set it (models/README.md, "Initialisation"): linear and
        conv weights drawn from PyTorch's default, ``U(-1/sqrt(fan_in), 1/sqrt(fan_in))`` (kaiming-uniform with
        ``a = sqrt(5)``), biases zero, embeddings ``N(0, 0.02)``; the projections marked ``_residual_out`` (the
        FFN's down projection, attention's and Mamba-3's output) drawn from that default divided by
        ``sqrt(2 num_layers)``. The weights are drawn again rather than kept, so the rule holds for weights a
        constructor zeroed and for models built on the meta device. A tied LM head keeps the embedding's draw."""
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=AUTHORS_EMBEDDING_STD)
        elif isinstance(module, (nn.Linear, nn.Conv1d)):
            if isinstance(module, LMHead) and self.config.tie_word_embeddings:
                return
            scale = math.sqrt(2 * self.config.num_layers) if getattr(module, "_residual_out", False) else 1.0
            bound = 1.0 / math.sqrt(module.weight[0].numel()) / scale  # weight[0]: one output's fan-in
            nn.init.uniform_(module.weight, -bound, bound)
            if module.bias is not None:
                nn.init.zeros_(module.bias)


class KDNModel(KDNPreTrainedModel):
    """The backbone: embedding, blocks, final norm. Returns hidden states ``[B, T, d]``."""

    def __init__(self, config: KDNConfig) -> None:
        super().__init__(config)
        self.embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([KDNBlock(config, i) for i in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, fused=config.fused)
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.embeddings = value

    def forward(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, cache: KDNCache | None = None,
        use_cache: bool = False, cu_seqlens: Tensor | None = None, output_beta_eff: bool = False,
        inputs_embeds: Tensor | None = None,
    ) -> tuple[Tensor, KDNCache | None, tuple[Tensor | None, ...] | None]:
        """Returns ``(hidden [B, T, d], cache, beta_eff per layer | None)``."""
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("pass exactly one of input_ids [B, T] and inputs_embeds [B, T, d]")
        h = self.embeddings(input_ids) if inputs_embeds is None else inputs_embeds
        B, T = h.shape[:2]
        if cu_seqlens is not None:
            if attention_mask is not None:
                raise ValueError("pass either cu_seqlens (packed documents) or attention_mask (padding), not both")
            check_cu_seqlens(cu_seqlens, T, B)
        if use_cache and cache is None:
            cache = KDNCache()
        betas, residual = [], None
        for layer in self.layers:
            h, residual, beta = layer(h, residual, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
                                      cu_seqlens=cu_seqlens, output_beta_eff=output_beta_eff)
            betas.append(beta)
        if use_cache:
            cache.seen_tokens += T
        # the last add is a plain FP32 add (one per step): fla's fused add + norm faulted here under FSDP2 (illegal
        # memory access, Triton 3.6, H200; docs/performance.md, "FSDP2"); the blocks' add_norm now runs our kernel
        # (kdn.modules.norm), not yet tried in this place. The norm comes back in the sublayers' dtype, as
        # add_norm's: the LM head's under FSDP2 (no autocast there)
        out = self.norm(h if residual is None else residual + h).to(h.dtype)
        return out, cache, (tuple(betas) if output_beta_eff else None)


def shifted_labels(labels: Tensor, attention_mask: Tensor | None, cu_seqlens: Tensor | None) -> Tensor:
    """Targets of next-token prediction, ``[B, T]``: ``labels`` shifted left, ``-100`` where there is no
    next token, where the current or the next token is padding, or where the next starts a new packed
    document."""
    target = F.pad(labels[:, 1:], (0, 1), value=-100)
    if attention_mask is not None:
        real = attention_mask[:, -labels.shape[1]:] != 0
        target = target.masked_fill(~(real & F.pad(real[:, 1:], (0, 1), value=False)), -100)
    if cu_seqlens is not None:
        starts = cu_seqlens[1:-1].to(labels.device)
        target[0, starts - 1] = -100
    return target


class KDNForCausalLM(KDNPreTrainedModel, GenerationMixin):
    """Causal LM head over :class:`KDNModel`; ``generate()`` runs with a :class:`models.cache.KDNCache` in HF's loop,
    or on CUDA through :mod:`models.generation` (static buffers, CUDA graphs)."""

    _tied_weights_keys = {"lm_head.weight": "model.embeddings.weight"}

    def __init__(self, config: KDNConfig) -> None:
        super().__init__(config)
        self.model = KDNModel(config)
        self.lm_head = LMHead(config.hidden_size, config.vocab_size, fused=config.fused)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the model builds its own KDNCache

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embeddings

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.model.embeddings = value

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, value: nn.Linear) -> None:
        self.lm_head = value

    def generate(  # type: ignore[override]
        self, inputs: Tensor | None = None, generation_config: object = None, logits_processor: object = None,
        stopping_criteria: object = None, prefix_allowed_tokens_fn: object = None, synced_gpus: object = None,
        assistant_model: object = None, streamer: object = None, negative_prompt_ids: object = None,
        negative_prompt_attention_mask: object = None, custom_generate: object = None, *,
        static_decode: bool | None = None, **kwargs: object,
    ) -> object:
        """HF's ``generate``; on CUDA (or with ``static_decode=True``) a request :func:`models.generation.generate`
        serves (greedy or sampling, EOS, stop strings, stopping criteria) runs there instead: one packed prefill,
        then a CUDA-graph-replayed one-token step over static buffers. ``static_decode=False``: always HF's loop."""
        others = {"logits_processor": logits_processor, "prefix_allowed_tokens_fn": prefix_allowed_tokens_fn,
                  "synced_gpus": synced_gpus, "assistant_model": assistant_model, "streamer": streamer,
                  "negative_prompt_ids": negative_prompt_ids,
                  "negative_prompt_attention_mask": negative_prompt_attention_mask, "custom_generate": custom_generate}
        if static_decode is None:
            static_decode = self.device.type == "cuda"
        if static_decode:
            from models.generation import hf_generate

            out = hf_generate(self, inputs, generation_config, stopping_criteria, kwargs, others)
            if out is not None:
                return out
        return super().generate(inputs, generation_config, stopping_criteria=stopping_criteria, **others, **kwargs)

    def prepare_inputs_for_generation(
        self, input_ids: Tensor, cache: KDNCache | None = None, attention_mask: Tensor | None = None,
        use_cache: bool = True, past_key_values: KDNCache | None = None, **kwargs: object,
    ) -> dict[str, object]:
        """Feed only the tokens the cache has not consumed yet (and keep ``logits_to_keep``)."""
        cache = cache if cache is not None else past_key_values
        if cache is not None and cache.seen_tokens:
            input_ids = input_ids[:, cache.seen_tokens:]
        inputs = {"input_ids": input_ids, "cache": cache, "attention_mask": attention_mask, "use_cache": use_cache}
        if kwargs.get("logits_to_keep") is not None:
            inputs["logits_to_keep"] = kwargs["logits_to_keep"]
        return inputs

    def forward(
        self, input_ids: Tensor | None = None, attention_mask: Tensor | None = None, labels: Tensor | None = None,
        past_key_values: KDNCache | None = None, use_cache: bool = False, cu_seqlens: Tensor | None = None,
        output_beta_eff: bool = False, inputs_embeds: Tensor | None = None, cache: KDNCache | None = None,
        logits_to_keep: int = 0, **kwargs: object,
    ) -> KDNCausalLMOutput:
        """``input_ids [B, T]`` -> logits ``[B, T, V]`` (last ``logits_to_keep`` positions when > 0), and
        with ``labels`` the mean next-token cross-entropy (shifted internally, ``-100`` ignored, no
        prediction across padding or a ``cu_seqlens`` document boundary). In training with
        ``config.fuse_cross_entropy``, the LM head's chunked linear cross-entropy computes the loss and
        ``logits`` is ``None``. ``cache`` and ``past_key_values`` are the same argument."""
        if cache is not None and past_key_values is not None and cache is not past_key_values:
            raise ValueError("pass the decoding cache once, as cache or past_key_values")
        cache = cache if cache is not None else past_key_values
        h, cache, betas = self.model(input_ids, attention_mask=attention_mask, cache=cache, use_cache=use_cache,
                                     cu_seqlens=cu_seqlens, output_beta_eff=output_beta_eff,
                                     inputs_embeds=inputs_embeds)
        loss, logits = None, None
        fused = labels is not None and self.training and self.config.fuse_cross_entropy
        if labels is not None:
            target = shifted_labels(labels, attention_mask, cu_seqlens)
            if fused:
                loss = self.lm_head(h, target)
            else:
                logits = self.lm_head(h)
                loss = F.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)).flatten(0, 1),
                                       target.flatten(), ignore_index=-100)
        if not fused and logits is None:
            logits = self.lm_head(h[:, -logits_to_keep:] if logits_to_keep else h)
        elif logits is not None and logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        out_cache = {CACHE_FIELD: cache if use_cache else None}
        return KDNCausalLMOutput(loss=loss, logits=logits, beta_eff=betas, **out_cache)
