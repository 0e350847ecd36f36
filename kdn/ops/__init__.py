"""The math of KDN, one calling convention (tensors ``q, k, v, g, omega, r`` first, settings as keywords).

- :mod:`kdn.ops.api`: validation and dispatch, the public functional API (re-exported here and by :mod:`kdn`);
- as fla lays out an op: :mod:`kdn.ops.naive`, the token-by-token references; :mod:`kdn.ops.chunk`, the Triton chunked
  entry points; :mod:`kdn.ops.fused_recurrent`, the one-token Triton step;
- :mod:`kdn.ops.torch_gain`, :mod:`kdn.ops.torch_chunk`: the chunked PyTorch path (any device);
- :mod:`kdn.ops.gate`: KDA's gate; :mod:`kdn.ops.validate`, :mod:`kdn.ops.packing`: input checks, packed sequences;
- :mod:`kdn.ops.triton`: the CUDA kernels (they and the Triton entries are imported on first use, so that the
  package needs no Triton);
  :mod:`kdn.ops.fla_internals`: the one way into fla's private kernels and helpers.
"""
from kdn.ops.api import (
    diagonal_kdn,
    diagonal_kdn_gain,
    diagonal_kdn_step,
    exact_kalman_memory,
    isotropic_kdn,
    isotropic_kdn_gain,
    isotropic_kdn_step,
)
from kdn.ops.gate import kda_gate

__all__ = [
    "diagonal_kdn", "isotropic_kdn", "exact_kalman_memory", "diagonal_kdn_gain", "isotropic_kdn_gain",
    "diagonal_kdn_step", "isotropic_kdn_step", "kda_gate",
]
