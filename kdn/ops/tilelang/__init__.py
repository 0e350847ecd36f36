"""Hopper (sm_90) kernels in TileLang: TMA loads and wgmma, for the backward launches that Triton keeps latency-bound.
Each has a portable Triton counterpart in :mod:`kdn.ops.triton` that chooses between the two."""
from kdn.ops.tilelang.wy import WYTiles, fit, supports, wy_dqkg_tilelang

__all__ = ["WYTiles", "fit", "supports", "wy_dqkg_tilelang"]
