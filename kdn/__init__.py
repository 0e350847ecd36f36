"""Kalman Delta Networks: exact math, chunked PyTorch, CUDA kernels and the mixer layers.

Tiers, as fla's: :mod:`kdn.ops` (the functional ops), :mod:`kdn.modules` (``nn`` building blocks),
:mod:`kdn.layers` (the mixers). Importing the package reads no environment variable and writes none.
"""
from kdn.layers import DiagonalKDN, IsotropicKDN, RecurrentCache
from kdn.modules import DeltaFrontEnd, GatedRMSNorm, ShortConv
from kdn.ops import (
    diagonal_kdn,
    diagonal_kdn_gain,
    diagonal_kdn_step,
    exact_kalman_memory,
    isotropic_kdn,
    isotropic_kdn_gain,
    isotropic_kdn_step,
)

__all__ = [
    "diagonal_kdn", "isotropic_kdn", "exact_kalman_memory",
    "diagonal_kdn_gain", "isotropic_kdn_gain", "diagonal_kdn_step", "isotropic_kdn_step",
    "DiagonalKDN", "IsotropicKDN", "RecurrentCache", "DeltaFrontEnd", "GatedRMSNorm", "ShortConv",
]
