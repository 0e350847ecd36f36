"""Shared by the mixers: padding masks, packed sequences, norms.

Conventions (all mixers): ``hidden_states [B, T, d_model]``; ``attention_mask [B, T']`` with 1 for
tokens and 0 for padding, of which the last ``T`` columns describe the current tokens (Hugging Face
style: during cached decoding the mask covers past and current tokens); ``cu_seqlens [N+1]``
offsets of documents packed along ``T`` (then ``B = 1``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from kdn.modules import RMSNorm, current_mask
from kdn.ops.packing import repack, unpack
from kdn.ops.validate import check_cu_seqlens

__all__ = ["current_mask", "repack", "unpack", "unpack_all", "check_cu_seqlens", "last_index", "RMSNorm"]


def unpack_all(xs: Sequence[Tensor], fills: Sequence[float], cu_seqlens: Tensor | None) -> list[Tensor]:
    """:func:`unpack` each tensor of ``xs`` (unchanged when ``cu_seqlens`` is ``None``)."""
    if cu_seqlens is None:
        return list(xs)
    return [unpack(x, cu_seqlens, f) for x, f in zip(xs, fills)]


def last_index(B: int, T: int, cu_seqlens: Tensor | None, device: torch.device) -> Tensor:
    """Index of each sequence's last token in its (unpacked) row: ``[N]``."""
    if cu_seqlens is None:
        return torch.full((B,), T - 1, dtype=torch.long, device=device)
    return (cu_seqlens[1:] - cu_seqlens[:-1] - 1).to(device=device, dtype=torch.long)
