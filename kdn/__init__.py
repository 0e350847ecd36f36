"""Kalman Delta Networks: exact math, chunked PyTorch, CUDA kernels and the mixer layers.

Tiers, as fla's: :mod:`kdn.ops` (the functional ops), :mod:`kdn.modules` (``nn`` building blocks),
:mod:`kdn.layers` (the mixers). Importing the package reads no environment variable and writes none.
The functional API is :mod:`kdn.ops`' own list (``kdn.ops.__all__``), re-exported as it stands.
"""
from kdn import ops
from kdn.layers import DiagonalKDN, IsotropicKDN, RecurrentCache
from kdn.modules import DeltaFrontEnd, GatedRMSNorm, ShortConv
from kdn.ops import *  # noqa: F403 - the names of kdn.ops.__all__

__all__ = [*ops.__all__, "DiagonalKDN", "IsotropicKDN", "RecurrentCache", "DeltaFrontEnd", "GatedRMSNorm", "ShortConv"]
