"""Packed sequences (``cu_seqlens``, fla's convention) to right-padded batches and back."""
from __future__ import annotations

import torch
from torch import Tensor


def unpack(x: Tensor, cu_seqlens: Tensor, fill: float) -> Tensor:
    """``[1, T, *rest]`` packed documents -> a right-padded batch ``[N, L, *rest]`` (pad value ``fill``)."""
    offsets = cu_seqlens.tolist()
    L = max(b - a for a, b in zip(offsets, offsets[1:]))
    out = x.new_full((len(offsets) - 1, L, *x.shape[2:]), fill)
    for i, (a, b) in enumerate(zip(offsets, offsets[1:])):
        out[i, : b - a] = x[0, a:b]
    return out


def repack(y: Tensor, cu_seqlens: Tensor) -> Tensor:
    """Inverse of :func:`unpack`: ``[N, L, *rest]`` -> ``[1, T, *rest]``."""
    offsets = cu_seqlens.tolist()
    return torch.cat([y[i, : b - a] for i, (a, b) in enumerate(zip(offsets, offsets[1:]))], 0)[None]
