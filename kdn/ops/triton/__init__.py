"""The CUDA kernels of KDN (Triton), split by concern; their chunked entry points (:func:`chunk_diagonal_kdn`,
:func:`chunk_isotropic_kdn`, :func:`chunk_kda`) are :mod:`kdn.ops.chunk`, where fla keeps an op's.

- :mod:`~kdn.ops.triton.gain_diagonal`, :mod:`~kdn.ops.triton.gain_isotropic`: the fused gain scans;
- :mod:`~kdn.ops.triton.memory`, :mod:`~kdn.ops.triton.wy`: the asymmetric memory and its WY backward;
- :mod:`~kdn.ops.triton.gate`: KDA's gate in one pass; :mod:`~kdn.ops.triton.safe_gate`: the check of fla's
  tensor-core path (its function keeps to the module: ``from kdn.ops.triton.safe_gate import safe_gate``);
  :mod:`~kdn.ops.triton.utils`: the shared ``@triton.jit`` helpers and segment sizing.
"""
from kdn.ops.triton.gain_diagonal import diagonal_gain, diagonal_gain_dplr
from kdn.ops.triton.gain_isotropic import isotropic_gain
from kdn.ops.triton.safe_gate import SafeGate, count_safe_gate_reads, exact_only
from kdn.ops.triton.utils import gain_segments

__all__ = [
    "diagonal_gain", "diagonal_gain_dplr", "isotropic_gain", "SafeGate", "count_safe_gate_reads", "exact_only",
    "gain_segments",
]
