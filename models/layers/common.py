"""Helpers shared by the mixers: padding masks, packed sequences, norms.

Conventions (all mixers): ``hidden_states [B, T, d_model]``; ``attention_mask [B, T']`` with 1 for
tokens and 0 for padding, of which the last ``T`` columns describe the current tokens (Hugging Face
style: during cached decoding the mask covers past and current tokens); ``cu_seqlens [N+1]``
offsets of documents packed along ``T`` (then ``B = 1``).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


def current_mask(attention_mask: Tensor | None, B: int, T: int) -> Tensor | None:
    """The boolean mask of the current ``T`` tokens, ``[B, T]``, or ``None`` when every token is real."""
    if attention_mask is None:
        return None
    if attention_mask.dim() != 2 or attention_mask.shape[0] != B or attention_mask.shape[1] < T:
        raise ValueError(
            f"attention_mask must be [B, >=T] = [{B}, >={T}] of 0/1, got {list(attention_mask.shape)}")
    return attention_mask[:, -T:].to(torch.bool)


def check_cu_seqlens(cu_seqlens: Tensor, B: int, T: int) -> None:
    """Raise a ``ValueError`` unless ``cu_seqlens`` holds increasing offsets from 0 to ``T`` with ``B = 1``."""
    if B != 1:
        raise ValueError(f"cu_seqlens needs packed input of batch size 1, got batch size {B}")
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor [N+1] of offsets, got shape {list(cu_seqlens.shape)}")
    offsets = cu_seqlens.tolist()
    if offsets[0] != 0 or offsets[-1] != T or any(b <= a for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"cu_seqlens must increase strictly from 0 to T={T}, got {offsets}")


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


class RMSNorm(nn.Module):
    """RMSNorm over the last dimension, computed in FP32; ``x [..., D]``."""

    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.float()).to(x.dtype)


class SwishGatedRMSNorm(RMSNorm):
    """RMSNorm multiplied by ``silu(gate)`` (fla's ``FusedRMSNormGated`` with ``activation="swish"``)."""

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:  # type: ignore[override]
        return (super().forward(x).float() * F.silu(gate.float())).to(x.dtype)
