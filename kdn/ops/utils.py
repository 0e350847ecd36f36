"""Dtype and device helpers shared by the ops and the modules."""
from __future__ import annotations

import functools

import torch
from torch import Tensor

# A KDN state: the memory ``S [B,H,K,V]`` and the uncertainty (``p [B,H,K]`` diagonal, ``b [B,H]`` isotropic)
State = tuple[Tensor, Tensor]


def upcast(x: Tensor) -> Tensor:
    """``x`` in at least FP32 (float64 stays float64)."""
    return x if x.dtype == torch.float64 else x.float()


@functools.cache
def _fla_importable() -> bool:
    try:
        import fla.modules  # noqa: F401
    except ImportError:
        return False
    return True


def fla_fused(x: Tensor, fused: bool = True) -> bool:
    """Whether ``x`` goes through the fused CUDA kernels (ours and fla's): ``fused`` asked for, ``x`` on CUDA and below
    float64, fla installed. ``fused=False`` runs the PyTorch code on every device (the GPU tests compare both)."""
    return fused and x.is_cuda and x.dtype != torch.float64 and _fla_importable()
