"""Causal softmax attention with RoPE, full or sliding-window.

Unmasked full attention runs SDPA's causal (flash) kernel. Windows, packed documents, padding and cached prefixes
run block-sparse ``flex_attention`` on CUDA (:mod:`models.layers.window_attention`: no block outside the window or
the document is computed, no ``[T, T]`` mask is built) and SDPA with a dense mask elsewhere (``backend``:
``"auto"``; ``"sdpa"`` forces the dense masks, ``"flex"`` the block masks on any device, forward only off CUDA).

A sliding window of ``W`` lets a token see itself and the ``W - 1`` previous tokens of its sequence;
the decoding cache then keeps only the last ``W - 1`` keys and values (bounded memory). Packed prompts
(``cu_seqlens``) prefill a cache from each document's own keys and values; a static cache
(:class:`models.cache.StaticKDNCache`) decodes against fixed ring buffers. Positions
count real tokens only, so a left-padded row gets the same positions as the unpadded sequence;
padded keys are never attended. ``cu_seqlens`` restricts attention to each packed document and
restarts positions at each document.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from kdn.layers import RecurrentCache
from kdn.modules import Linear, positions_in_sequence
from models.layers.common import check_cu_seqlens, current_mask
from models.layers.window_attention import block_mask_for, compiled_for, flex_windowed

BACKENDS = ("auto", "flex", "sdpa")


@dataclass
class AttentionConfig:
    """The attention mixer's options (``mixer=attn``): none of its own. Its window is the backbone's (one knob for
    every attention layer: ``KDNConfig.window``, the size table's by default, ``backbone.window`` in training;
    ``None``, or the ``A`` layer code, is full attention), checked by :func:`check_window`, and its RoPE base is the
    backbone's ``rope_theta``."""


def check_window(window: object) -> None:
    """Refuse a window that is neither a positive int (tokens of the sliding window) nor ``None`` (full attention)."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window <= 0):
        raise ValueError(f"window must be a positive int (sliding window) or None (full attention), got {window!r}")


def rope_angles(pos: Tensor, K: int, theta: float) -> tuple[Tensor, Tensor]:
    """``cos, sin [B, T, 1, K/2]`` (FP32) of positions ``pos [B, T]``, for half-split RoPE of head size ``K``."""
    inv_freq = theta ** (-torch.arange(0, K, 2, device=pos.device, dtype=torch.float32) / K)
    ang = pos.to(torch.float32)[..., None] * inv_freq  # [B, T, K/2]
    return ang.cos()[:, :, None], ang.sin()[:, :, None]


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x [B, T, H, K]`` by ``cos, sin [B, T, 1, K/2]`` (half-split RoPE), in FP32."""
    K = x.shape[-1]
    xf = x.float()
    x0, x1 = xf[..., : K // 2], xf[..., K // 2:]
    return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], -1).to(x.dtype)


def apply_rope(x: Tensor, pos: Tensor, theta: float) -> Tensor:
    """Rotate ``x [B, T, H, K]`` by positions ``pos [B, T]`` (half-split RoPE, base ``theta``), in FP32."""
    return rotate(x, *rope_angles(pos, x.shape[-1], theta))


def rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """:func:`rotate`, compiled into one pass on CUDA (eager, it makes about eight FP32 passes over ``x``: a sixth of a
    32K-token windowed layer's time); static shapes when gradients are needed, dynamic otherwise. The angles come in
    as a table computed once for ``q`` and ``k``: computed inside, the compiled kernels evaluate ``pow``, ``sin``
    and ``cos`` for every element of ``x``, forward and backward, and took 11-12x the time of the bytes they move."""
    return compiled_for(rotate, x)(x, cos, sin) if x.is_cuda else rotate(x, cos, sin)


def sliding_attention(q: Tensor, k: Tensor, v: Tensor, window: int) -> Tensor:
    """Causal attention of one sequence within a window, ``q, k, v [B, H, n, K]``, by blocks of ``window`` queries:
    each block reads the keys from ``window - 1`` before its first query to its last (masks of ``window x 2 window``,
    never ``n x n``)."""
    n = q.shape[2]
    o = torch.empty_like(q)
    for s in range(0, n, window):
        e, lo = min(s + window, n), max(0, s - window + 1)
        i = torch.arange(s, e, device=q.device)[:, None]
        j = torch.arange(lo, e, device=q.device)[None, :]
        band = (j <= i) & (i - j < window)
        o[:, :, s:e] = F.scaled_dot_product_attention(q[:, :, s:e], k[:, :, lo:e], v[:, :, lo:e], attn_mask=band)
    return o


class Attention(nn.Module):
    """Multi-head causal attention: ``num_heads x head_dim`` heads, ``window`` (``None``: full), RoPE, and the
    ``backend`` of masked attention (module docstring)."""

    def __init__(
        self, hidden_size: int = 2048, num_heads: int = 16, head_dim: int = 128, *, window: int | None,
        rope_theta: float = 10000.0, layer_idx: int | None = None, backend: str = "auto",
    ) -> None:
        super().__init__()
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {list(BACKENDS)} (auto: flex_attention's block masks on CUDA, "
                             f"dense SDPA masks elsewhere), got {backend!r}")
        check_window(window)
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.window, self.rope_theta, self.layer_idx, self.backend = window, rope_theta, layer_idx, backend
        inner = num_heads * head_dim
        self.q_proj = Linear(hidden_size, inner, bias=False)
        self.k_proj = Linear(hidden_size, inner, bias=False)
        self.v_proj = Linear(hidden_size, inner, bias=False)
        self.o_proj = Linear(inner, hidden_size, bias=False)

    def forward(
        self, hidden_states: Tensor, attention_mask: Tensor | None = None,
        past_key_values: RecurrentCache | None = None, use_cache: bool = False,
        cu_seqlens: Tensor | None = None, output_beta_eff: bool = False, **kwargs: object,
    ) -> tuple[Tensor, None, RecurrentCache | None]:
        """``hidden_states [B, T, d]`` -> ``(o [B, T, d], None, cache)``."""
        x = hidden_states
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        mask = current_mask(attention_mask, B, T)
        valid = mask if mask is not None else torch.ones(B, T, dtype=torch.bool, device=x.device)
        last = past_key_values.get(self.layer_idx) if past_key_values is not None else None
        if last is not None and "cursor" in last:  # a static cache (models.cache.StaticKDNCache): ring buffers
            if T != 1 or cu_seqlens is not None or mask is not None:
                raise ValueError("a static cache decodes one token per row (T = 1), without cu_seqlens or padding; "
                                 "prefill with a KDNCache and load it into the static cache")
            return self.static_step(x, last), None, past_key_values
        if cu_seqlens is not None:
            if last is not None:
                raise ValueError("attention layers cannot continue packed sequences (cu_seqlens) from a cache; "
                                 "prefill packed prompts from an empty cache, then decode a padded batch")
            check_cu_seqlens(cu_seqlens, T, B)
            if use_cache:
                return self.packed_prefill(x, cu_seqlens, past_key_values)
            pos = positions_in_sequence(B, T, cu_seqlens, x.device)
            start = None
        else:
            start = last["next_pos"] if last is not None else torch.zeros(B, dtype=torch.long, device=x.device)
            pos = start[:, None] + valid.long().cumsum(1) - valid.long()
        q, k, v = self._qkv(x, pos)
        k_pos, k_valid = pos, valid
        if last is not None:
            k, v = torch.cat([last["k"], k], 2), torch.cat([last["v"], v], 2)
            k_pos, k_valid = torch.cat([last["pos"], pos], 1), torch.cat([last["valid"], valid], 1)
        L = k.shape[2] - T
        plain = last is None and mask is None and cu_seqlens is None and (self.window is None or self.window >= T)
        if plain:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.block_sparse(x) and T > 1:
            if last is None and mask is None:  # by index: the window and the documents
                bm = block_mask_for(T, T, self.window, cu_seqlens=cu_seqlens, device=x.device)
            else:
                bm = block_mask_for(T, L + T, self.window, q_pos=pos, k_pos=k_pos, k_valid=k_valid, device=x.device)
            o = flex_windowed(q, k, v, bm)
        else:
            qi = torch.arange(T, device=x.device) + L
            kj = torch.arange(L + T, device=x.device)
            allowed = (kj[None, :] <= qi[:, None])[None] & k_valid[:, None, :]  # [B, T, L+T]
            if self.window is not None:
                allowed = allowed & (pos[:, :, None] - k_pos[:, None, :] < self.window)
            if cu_seqlens is not None:
                doc = torch.searchsorted(cu_seqlens[1:].to(x.device), kj, right=True)
                allowed = allowed & (doc[:, None] == doc[None, :])[None]
            allowed = allowed | (kj[None, :] == qi[:, None])[None]  # a padded query sees itself: no empty row
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed[:, None])
        if use_cache:
            if past_key_values is None:
                past_key_values = RecurrentCache()
            keep = k.shape[2] if self.window is None else min(k.shape[2], self.window - 1)
            past_key_values.update(
                self.layer_idx, k=k[:, :, k.shape[2] - keep:], v=v[:, :, k.shape[2] - keep:],
                pos=k_pos[:, k_pos.shape[1] - keep:], valid=k_valid[:, k_valid.shape[1] - keep:],
                next_pos=start + valid.long().sum(1))
        return self.o_proj(o.transpose(1, 2).reshape(B, T, H * K)), None, past_key_values

    def block_sparse(self, x: Tensor) -> bool:
        """Whether masked attention of ``x`` runs ``flex_attention``'s block masks (``backend``)."""
        return self.backend == "flex" or (self.backend == "auto" and x.is_cuda)

    def _qkv(self, x: Tensor, pos: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``q, k, v [B, H, T, K]`` of ``x [B, T, d]`` at positions ``pos [B, T]`` (RoPE on ``q`` and ``k``)."""
        B, T, _ = x.shape
        H, K = self.num_heads, self.head_dim
        cos, sin = rope_angles(pos, K, self.rope_theta)
        q = rope(self.q_proj(x).view(B, T, H, K), cos, sin).transpose(1, 2)
        k = rope(self.k_proj(x).view(B, T, H, K), cos, sin).transpose(1, 2)
        return q, k, self.v_proj(x).view(B, T, H, K).transpose(1, 2)

    def packed_prefill(self, x: Tensor, cu_seqlens: Tensor, cache: RecurrentCache | None
                       ) -> tuple[Tensor, None, RecurrentCache]:
        """Packed prompts ``x [1, T, d]`` (``cu_seqlens [N+1]``) from an empty cache: attention within each document
        (one block-sparse call for all of them, or one SDPA call per document, by blocks past the window; never a
        ``[T, T]`` mask), and per document the keys
        and values a decoding step needs, the latest last (left-padded): ``k, v [N, H, L, K]``, ``valid [N, L]``,
        ``pos [N, L]``, ``next_pos [N]`` (``L``: the longest document, at most ``window - 1`` when sliding)."""
        H, K = self.num_heads, self.head_dim
        T = x.shape[1]
        pos = positions_in_sequence(1, T, cu_seqlens, x.device)
        q, k, v = self._qkv(x, pos)
        offsets = cu_seqlens.tolist()
        lengths = [b - a for a, b in zip(offsets, offsets[1:])]
        if self.block_sparse(x):
            o = flex_windowed(q, k, v, block_mask_for(T, T, self.window, cu_seqlens=cu_seqlens, device=x.device))
        else:
            o = self._per_document(q, k, v, offsets)
        longest = max(lengths)
        L = longest if self.window is None else min(longest, self.window - 1)
        ends = cu_seqlens[1:].to(x.device)
        idx = ends[:, None] - L + torch.arange(L, device=x.device)  # [N, L]: each document's last L tokens
        valid = idx >= cu_seqlens[:-1].to(x.device)[:, None]
        idx = idx.clamp(min=0)
        if cache is None:
            cache = RecurrentCache()
        cache.update(self.layer_idx, k=k[0][:, idx].transpose(0, 1).contiguous(),
                     v=v[0][:, idx].transpose(0, 1).contiguous(), pos=pos[0][idx] * valid, valid=valid,
                     next_pos=torch.tensor(lengths, device=x.device))
        return self.o_proj(o.transpose(1, 2).reshape(1, T, H * K)), None, cache

    def _per_document(self, q: Tensor, k: Tensor, v: Tensor, offsets: list[int]) -> Tensor:
        """Attention of ``q, k, v [1, H, T, K]`` within each document of ``offsets``, one SDPA call per document."""
        o = torch.empty_like(q)
        for a, b in zip(offsets, offsets[1:]):
            if self.window is None or self.window >= b - a:
                o[:, :, a:b] = F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b],
                                                              is_causal=True)
            else:
                o[:, :, a:b] = sliding_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], self.window)
        return o

    def static_step(self, x: Tensor, state: dict[str, Tensor]) -> Tensor:
        """One token per row, ``x [B, 1, d]``, against the ring buffers of a static cache: ``k, v [B, H, L, K]``,
        ``valid [B, L]``, ``next_pos [B]`` and ``cursor [1]`` (the slot this token takes, modulo ``L``), updated in
        place with no host sync (``L`` is the window when sliding, so the ring holds exactly the window)."""
        B = x.shape[0]
        H, K = self.num_heads, self.head_dim
        pos = state["next_pos"][:, None]
        q, k, v = self._qkv(x, pos)
        L = state["k"].shape[2]
        slot = state["cursor"].remainder(L)
        state["k"].index_copy_(2, slot, k)
        state["v"].index_copy_(2, slot, v)
        state["valid"].index_fill_(1, slot, True)
        state["next_pos"].add_(1)
        state["cursor"].add_(1)
        o = F.scaled_dot_product_attention(q, state["k"], state["v"], attn_mask=state["valid"][:, None, None])
        return self.o_proj(o.transpose(1, 2).reshape(B, 1, H * K))
