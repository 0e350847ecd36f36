"""The ``nn`` building blocks of the mixers (as fla's ``fla/modules``).

- :mod:`kdn.modules.front_end`: :class:`DeltaFrontEnd` (what a delta mixer does with the projections, short convs,
  retention gate and output norm its layer declares; :func:`kda_retention`, :func:`sigmoid_retention` build the
  gate's parameters),
  :class:`ShortConv`, :class:`RMSNorm`, :class:`GatedRMSNorm`, :class:`Linear` / :func:`linear` (FP32 weight
  gradients under autocast, stacked projections), :func:`stacked_weights` (the stack kept between decoding steps) and
  :func:`cached_weight_casts`;
- the fused CUDA kernels they call, imported on first use: :mod:`kdn.modules.conv` (short convs + L2 norms),
  :mod:`kdn.modules.norm` (residual add + RMSNorm), :mod:`kdn.modules.swiglu` (SwiGLU on the joint projection).
"""
from kdn.modules.front_end import (
    L2_EPS,
    DeltaFrontEnd,
    GatedRMSNorm,
    Linear,
    RMSNorm,
    ShortConv,
    cached_weight_casts,
    current_mask,
    finish,
    fla_fused,
    input_stage,
    inv_softplus,
    kda_gate,
    kda_retention,
    l2_normalize,
    linear,
    low_rank,
    positions_in_sequence,
    sigmoid_retention,
    split_outputs,
    stacked_weights,
    upcast,
)

__all__ = [
    "DeltaFrontEnd", "ShortConv", "RMSNorm", "GatedRMSNorm", "Linear", "linear", "low_rank", "input_stage", "finish",
    "split_outputs", "stacked_weights", "cached_weight_casts", "current_mask", "positions_in_sequence",
    "inv_softplus", "kda_gate", "l2_normalize", "fla_fused", "upcast", "L2_EPS", "kda_retention", "sigmoid_retention",
]
