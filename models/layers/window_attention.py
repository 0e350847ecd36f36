"""Block-sparse causal attention on PyTorch's ``flex_attention``: sliding windows, packed documents, padding and
cached prefixes without a dense mask.

The keys of one call are ``KV = L + Q`` tokens: ``L`` cached ones, then the ``Q`` queries' own, so query ``i`` sits
at key index ``L + i``. Two kinds of mask:

- **by index** (no padding, no cache): a query sees the keys ``j <= L + i`` with ``L + i - j < window``, of its own
  document when ``doc`` is given. Training runs only these, so their :class:`BlockMask` marks the blocks that are
  wholly inside the mask as full (no per-element mask there) and is cached per shape (plain windows) or built once
  per batch and shared by every layer (documents).
- **by position** (padding or a cache; built per call, cheap next to the attention): positions count real tokens
  (``q_pos [B, Q]``, ``k_pos [B, KV]``, both non-decreasing along a row, as cumulative counts of real tokens are), a
  query sees the real keys at or before it whose position is less than ``window`` behind its own, and always itself
  (a padded query never has an empty row).

The blocks a query block may need are computed from closed-form bounds per block (the causal edge, the window's
lower edge, the document's start), never from a ``[Q, KV]`` mask: ``O((Q/128) (KV/128))`` work. Blocks outside
the bounds are never computed. Training calls ``flex_attention`` compiled for its one shape; inference (no
gradients) calls it compiled with dynamic shapes, so prompts of many lengths compile once.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, and_masks, flex_attention, or_masks

BLOCK = 128  # flex_attention's default block (queries and keys)
_CACHE_SIZE = 8  # block masks by index kept: a training shape's plain window, and the documents of batches in flight

_compiled: dict[tuple[Callable, bool], Callable[..., Tensor]] = {}
_masks: OrderedDict[tuple, tuple[object, BlockMask]] = OrderedDict()


def needs_grad(*xs: Tensor) -> bool:
    """Whether autograd records an operation on ``xs``."""
    return torch.is_grad_enabled() and any(t.requires_grad for t in xs)


def compiled_for(fn: Callable[..., Tensor], *xs: Tensor) -> Callable[..., Tensor]:
    """``fn`` compiled once per process: for static shapes when ``xs`` need gradients (training: one shape), for
    dynamic shapes otherwise (prompts of any length). Kept apart, each stays far from Dynamo's recompile limit."""
    key = (fn, not needs_grad(*xs))
    if key not in _compiled:
        _compiled[key] = torch.compile(fn, dynamic=key[1])
    return _compiled[key]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pad(x: Tensor, n: int, value: float | bool) -> Tensor:
    """``x [..., m]`` padded with ``value`` to ``[..., n]`` (the mask reads whole blocks)."""
    if x.shape[-1] == n:
        return x
    return torch.cat([x, x.new_full((*x.shape[:-1], n - x.shape[-1]), value)], -1)


def _index_mask_mod(L: int, window: int | None, doc: Tensor | None) -> Callable:
    """The by-index mask: causal, within ``window``, within the document ``doc [KVp]`` (per key index)."""
    mods: list[Callable] = [lambda b, h, qi, kj: kj <= qi + L]
    if window is not None:
        mods.append(lambda b, h, qi, kj: qi + L - kj < window)
    if doc is not None:
        mods.append(lambda b, h, qi, kj: doc[qi + L] == doc[kj])
    return and_masks(*mods)


def _position_mask_mod(L: int, window: int | None, q_pos: Tensor, k_pos: Tensor, k_valid: Tensor) -> Callable:
    """The by-position mask: ``q_pos [B, Qp]``, ``k_pos [B, KVp]``, ``k_valid [B, KVp]``."""
    mods: list[Callable] = [lambda b, h, qi, kj: kj <= qi + L, lambda b, h, qi, kj: k_valid[b, kj]]
    if window is not None:
        mods.append(lambda b, h, qi, kj: q_pos[b, qi] - k_pos[b, kj] < window)
    return or_masks(and_masks(*mods), lambda b, h, qi, kj: kj == qi + L)


def _to_lists(flags: Tensor) -> tuple[Tensor, Tensor]:
    """``flags [B, Qb, KVb]`` -> ``(count [B, 1, Qb] int32, indices [B, 1, Qb, KVb] int32)``, flagged first."""
    count = flags.sum(-1, dtype=torch.int32)
    order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
    return count[:, None], order[:, None]


def _block_mask(lo: Tensor, Q: int, KV: int, full: Tensor | None, mask_mod: Callable) -> BlockMask:
    """A :class:`BlockMask` from each query block's first key index ``lo [B, Qb]`` (the causal edge is the last
    query's own index) and the blocks wholly inside the mask ``full [B, Qb, KVb]`` (``None``: none known)."""
    L, Qb, KVb = KV - Q, _cdiv(Q, BLOCK), _cdiv(KV, BLOCK)
    dev = lo.device
    last_q = torch.clamp(torch.arange(Qb, device=dev) * BLOCK + BLOCK - 1, max=Q - 1)
    hi = (L + last_q) // BLOCK  # [Qb]
    n = torch.arange(KVb, device=dev)
    inside = (n >= (lo // BLOCK)[..., None]) & (n <= hi[:, None])  # [B, Qb, KVb]
    partial = inside if full is None else inside & ~full
    count, idx = _to_lists(partial)
    full_count, full_idx = (None, None) if full is None else _to_lists(full & inside)
    return BlockMask.from_kv_blocks(count, idx, full_count, full_idx, BLOCK_SIZE=BLOCK, mask_mod=mask_mod,
                                    seq_lengths=(Q, KV))


def index_block_mask(Q: int, KV: int, window: int | None, cu_seqlens: Tensor | None, device: torch.device
                     ) -> BlockMask:
    """The by-index :class:`BlockMask` for ``Q`` queries after ``KV - Q`` earlier keys, of one row of documents
    ``cu_seqlens [N+1]`` (offsets over the ``KV`` keys; ``None``: one document). Full blocks are marked."""
    L, Qb, KVb = KV - Q, _cdiv(Q, BLOCK), _cdiv(KV, BLOCK)
    first_q = torch.arange(Qb, device=device) * BLOCK  # [Qb]
    last_q = torch.clamp(first_q + BLOCK - 1, max=Q - 1)
    first_k = torch.arange(KVb, device=device) * BLOCK  # [KVb]
    last_k = torch.clamp(first_k + BLOCK - 1, max=KV - 1)
    lo = torch.zeros(Qb, dtype=torch.long, device=device)
    full = (last_k[None, :] <= (L + first_q)[:, None]) & (first_k[None, :] + BLOCK - 1 < KV)  # causal, whole keys
    full &= (last_q[:, None] - first_q[:, None] == BLOCK - 1)  # whole query blocks
    if window is not None:
        lo = torch.clamp(L + first_q - window + 1, min=0)
        full &= (L + last_q)[:, None] - first_k[None, :] < window
    doc = None
    if cu_seqlens is not None:
        offsets = cu_seqlens.to(device=device, dtype=torch.long)
        doc = torch.searchsorted(offsets[1:], torch.arange(KV, device=device), right=True)
        lo = torch.maximum(lo, offsets[doc[L + first_q]])  # the first query's document starts there
        same = lambda a, b: doc[a] == doc[b]  # noqa: E731
        full &= (same(L + first_q, L + last_q)[:, None] & same(first_k, last_k)[None, :]
                 & same(L + first_q[:, None], first_k[None, :]))
        doc = _pad(doc, max(KVb * BLOCK, L + Qb * BLOCK), -1)  # the mask reads whole blocks of both
    return _block_mask(lo[None], Q, KV, full[None], _index_mask_mod(L, window, doc))


def position_block_mask(q_pos: Tensor, k_pos: Tensor, k_valid: Tensor, window: int | None) -> BlockMask:
    """The by-position :class:`BlockMask` of ``q_pos [B, Q]`` against ``k_pos, k_valid [B, KV]`` (the last ``Q``
    keys are the queries' own). No block is marked full: every computed block applies the mask."""
    B, Q = q_pos.shape
    KV = k_pos.shape[1]
    Qb, KVb = _cdiv(Q, BLOCK), _cdiv(KV, BLOCK)
    first_q = torch.arange(Qb, device=q_pos.device) * BLOCK
    if window is None:
        lo = torch.zeros(B, Qb, dtype=torch.long, device=q_pos.device)
    else:  # the first key whose position is less than `window` behind the block's first query
        lo = torch.searchsorted(k_pos.contiguous(), (q_pos[:, first_q] - window).contiguous(), right=True)
    mod = _position_mask_mod(KV - Q, window, _pad(q_pos, Qb * BLOCK, 0), _pad(k_pos, KVb * BLOCK, 0),
                             _pad(k_valid, KVb * BLOCK, False))
    return _block_mask(lo, Q, KV, None, mod)


def cached_block_mask(key: tuple, source: Tensor | None, build: Callable[[], BlockMask]) -> BlockMask:
    """``build()``, reused while ``key`` and the tensor ``source`` (the same live object, unmodified) match: the
    layers of one forward share the mask of their batch, and a training shape's plain window is built once."""
    version = None if source is None else source._version
    full_key = (*key, None if source is None else id(source), version)
    hit = _masks.get(full_key)
    if hit is not None and (source is None or hit[0]() is source):
        _masks.move_to_end(full_key)
        return hit[1]
    mask = build()
    _masks[full_key] = (None if source is None else weakref.ref(source), mask)
    while len(_masks) > _CACHE_SIZE:
        _masks.popitem(last=False)
    return mask


@torch.compiler.disable  # the masks are built eagerly from host-side shapes and cached; the attention is compiled
def block_mask_for(Q: int, KV: int, window: int | None, *, cu_seqlens: Tensor | None = None,
                   q_pos: Tensor | None = None, k_pos: Tensor | None = None, k_valid: Tensor | None = None,
                   device: torch.device) -> BlockMask:
    """The :class:`BlockMask` of one attention call: by position when ``q_pos`` is given (padding, cache; built per
    call, from tensors each layer makes), else by index (documents ``cu_seqlens``; cached)."""
    if q_pos is not None:
        if k_pos is None or k_valid is None:
            raise ValueError("a mask by position needs q_pos, k_pos and k_valid")
        return position_block_mask(q_pos, k_pos, k_valid, window)
    return cached_block_mask((Q, KV, window, str(device)), cu_seqlens,
                             lambda: index_block_mask(Q, KV, window, cu_seqlens, device))


def flex_windowed(q: Tensor, k: Tensor, v: Tensor, block_mask: BlockMask) -> Tensor:
    """Attention of ``q [B, H, Q, K]`` over ``k, v [B, H, KV, K]`` under ``block_mask`` (softmax scale
    ``K ** -0.5``): compiled ``flex_attention`` on CUDA (static shapes when gradients are needed, dynamic otherwise),
    its unfused reference elsewhere (forward only)."""
    if q.device.type != "cuda":
        if needs_grad(q, k, v):
            raise RuntimeError(f"flex_attention has no backward on {q.device.type}: train there with the attention "
                               "backend 'auto' or 'sdpa', or run the 'flex' backend under torch.no_grad()")
        return flex_attention(q, k, v, block_mask=block_mask)
    return compiled_for(flex_attention, q, k, v)(q, k, v, block_mask=block_mask)
