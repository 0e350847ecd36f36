"""Backbones and baseline mixers as Hugging Face models.

``model_config(size, mixer, pattern)`` -> :class:`KDNConfig` (FFN width solved for parameter matching),
``build_model(cfg)`` -> :class:`KDNForCausalLM`; ``MIXERS`` is the mixer registry; ``generate(model, input_ids,
max_new_tokens, ...)`` decodes over static buffers (CUDA graphs on CUDA, :mod:`models.generation`). Importing this
package registers ``kdn_lm`` with ``AutoConfig`` and ``AutoModelForCausalLM``.
"""
from transformers import AutoConfig, AutoModelForCausalLM

from models.cache import KDNCache, StaticKDNCache
from models.configuration import KDNConfig, layer_pattern
from models.flops import count_flops_per_token
from models.generation import GenerateOutput, generate
from models.modeling import KDNCausalLMOutput, KDNForCausalLM, KDNModel
from models.registry import MIXERS, MixerSpec
from models.sizes import SIZES, build_model, model_config, parameter_counts, recurrent_state_size

AutoConfig.register(KDNConfig.model_type, KDNConfig, exist_ok=True)
AutoModelForCausalLM.register(KDNConfig, KDNForCausalLM, exist_ok=True)

__all__ = [
    "KDNConfig", "KDNForCausalLM", "KDNModel", "KDNCausalLMOutput", "KDNCache", "StaticKDNCache", "generate",
    "GenerateOutput", "MIXERS", "MixerSpec", "SIZES",
    "model_config", "build_model", "count_flops_per_token", "parameter_counts", "recurrent_state_size",
    "layer_pattern",
]
