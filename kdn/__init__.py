"""Kalman Delta Networks: exact math, chunked PyTorch, and the mixer layers."""
from kdn.api import (
    diagonal_kdn,
    diagonal_kdn_gain,
    diagonal_kdn_step,
    exact_kalman_memory,
    isotropic_kdn,
    isotropic_kdn_gain,
    isotropic_kdn_step,
)
from kdn.cache import RecurrentCache
from kdn.layers import DiagonalKDN, IsotropicKDN
from kdn.modules import DeltaFrontEnd, GatedRMSNorm, ShortConv

__all__ = [
    "diagonal_kdn", "isotropic_kdn", "exact_kalman_memory",
    "diagonal_kdn_gain", "isotropic_kdn_gain", "diagonal_kdn_step", "isotropic_kdn_step",
    "DiagonalKDN", "IsotropicKDN", "RecurrentCache", "DeltaFrontEnd", "GatedRMSNorm", "ShortConv",
]
