"""The decoding caches of :class:`models.KDNForCausalLM`: :class:`KDNCache` (grows, as ``transformers``' ``generate``
needs) and :class:`StaticKDNCache` (fixed buffers for :mod:`models.generation`)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kdn.layers import RecurrentCache


def _map_tensors(value: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    if isinstance(value, Tensor):
        return fn(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_map_tensors(v, fn) for v in value)
    if isinstance(value, dict):
        return {k: _map_tensors(v, fn) for k, v in value.items()}
    return value


class KDNCache(RecurrentCache):
    """Per-layer state (recurrent memories, short-conv histories, window-bounded attention keys and values).

    Every stored tensor has the batch on dim 0, so beam search and ``num_return_sequences`` can
    reorder or repeat it. Recurrent layers hold constant memory per sequence; a sliding-window
    attention layer at most ``window - 1`` past keys and values.
    """

    is_compileable = False

    @property
    def is_linear(self) -> list[bool]:
        """Tells ``generate`` that inputs must be sliced by :meth:`get_seq_length` when continuing."""
        return [False]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Number of tokens (per row, padding included) the cache has consumed."""
        return self.seen_tokens

    def map(self, fn: Callable[[Tensor], Tensor]) -> None:
        """Apply ``fn`` to every stored tensor (batch on dim 0)."""
        self.layers = {i: _map_tensors(state, fn) for i, state in self.layers.items()}

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Select rows ``beam_idx`` (beam search)."""
        self.map(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_select_indices(self, indices: Tensor) -> None:
        """Keep rows ``indices``."""
        self.map(lambda t: t[indices.to(t.device)])

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat each row ``repeats`` times (``num_return_sequences``)."""
        self.map(lambda t: t.repeat_interleave(repeats, dim=0))

    def num_elements(self) -> int:
        """Total number of stored elements (to check that recurrent memory does not grow)."""
        total = 0

        def count(t: Tensor) -> Tensor:
            nonlocal total
            total += t.numel()
            return t

        for state in self.layers.values():
            _map_tensors(state, count)
        return total


def _copy_into(dst: Any, src: Any, rows: slice | None = None) -> None:
    """Copy the tensors of ``src`` into the same-structured buffers ``dst`` (rows ``rows`` of dim 0 when given)."""
    if isinstance(dst, Tensor):
        target = dst if rows is None else dst[rows]
        if target.data_ptr() != src.data_ptr() or target.shape != src.shape:
            target.copy_(src)
        return
    for d, s in zip(dst, src):
        _copy_into(d, s, rows)


class StaticKDNCache(KDNCache):
    """Fixed decoding buffers for ``batch_size`` rows, read and written in place by the one-token step (the addresses a
    CUDA graph replays).

    Recurrent layers keep their state's tensors (memories in FP32, conv windows) with ``batch_size`` rows; attention
    layers a ring of ``ring_lengths[layer]`` slots (the window when sliding, the longest context when full):
    ``k, v [batch_size, H, L, K]``, ``valid [batch_size, L]``, ``next_pos [batch_size]`` (each row's next RoPE
    position) and ``cursor [1]`` (the slot the next token takes, modulo the view). A step reads and writes the first
    ``views[layer] <= L`` slots only (default: all ``L``): :meth:`get` gives it ``k, v [batch_size, H, view, K]`` and
    ``valid [batch_size, view]``, prefix slices of the buffers (same storage, so in-place writes and CUDA graphs
    captured on them reach the buffers). A view shorter than the ring is exact while no token wraps: prompt and new
    tokens fit in it. :meth:`load` copies a prefill's :class:`KDNCache` into the first rows (allocating the buffers on
    first use); the other rows are idle (zero state, their outputs ignored).
    """

    static = True

    def __init__(self, batch_size: int, ring_lengths: dict[int, int]) -> None:
        super().__init__()
        self.batch_size, self.ring_lengths = batch_size, dict(ring_lengths)
        self.views = dict(self.ring_lengths)

    def set_views(self, views: dict[int, int]) -> None:
        """Read the first ``views[layer]`` slots of each attention layer's ring (a layer not in ``views``: all)."""
        for i, n in views.items():
            ring = self.ring_lengths.get(i)
            if ring is None or isinstance(n, bool) or not isinstance(n, int) or not 0 < n <= ring:
                raise ValueError(f"layer {i} cannot read a view of {n!r} slots: give an int in [1, its ring length] "
                                 f"(ring lengths: {self.ring_lengths})")
        self.views = {i: views.get(i, ring) for i, ring in self.ring_lengths.items()}

    def get(self, layer_idx: int) -> dict[str, Any] | None:
        """A layer's buffers; for an attention layer read through a shorter view, ``k, v, valid`` cut to the view."""
        state = self.layers.get(layer_idx)
        view = self.views.get(layer_idx)
        if state is None or view is None or view == self.ring_lengths[layer_idx]:
            return state
        return {**state, "k": state["k"][:, :, :view], "v": state["v"][:, :, :view], "valid": state["valid"][:, :view]}

    def update(self, layer_idx: int, **state: Any) -> None:
        """Copy a layer's new state into its buffers (a tensor the step updated in place is left as it is)."""
        buffers = self.layers.get(layer_idx)
        if buffers is None:
            raise ValueError(f"layer {layer_idx} has no static buffers yet: load a prefill (StaticKDNCache.load) "
                             "before decoding")
        for name, value in state.items():
            _copy_into(buffers[name], value)

    def load(self, prefill: KDNCache, rows: int) -> None:
        """Reset every buffer and copy ``prefill`` (``rows`` sequences, batch on dim 0) into rows ``[0, rows)``."""
        if rows > self.batch_size:
            raise ValueError(f"a prefill of {rows} rows does not fit a static cache of {self.batch_size} rows")
        for i, state in prefill.layers.items():
            if "k" in state:
                self._load_attention(i, state, rows)
                continue
            if i not in self.layers:
                self.layers[i] = _map_tensors(
                    state, lambda t: t.new_zeros(self.batch_size, *t.shape[1:]).contiguous())
            buffers = self.layers[i]
            _map_tensors(buffers, lambda t: t.zero_())
            for name, value in state.items():
                _copy_into(buffers[name], value, slice(0, rows))

    def _load_attention(self, i: int, state: dict[str, Tensor], rows: int) -> None:
        k = state["k"]
        _, H, L, K = k.shape
        ring, view = self.ring_lengths[i], self.views[i]
        if L > view:
            fix = "raise max_cache_len" if view == ring else f"set a view of at least {L} slots (set_views)"
            raise ValueError(f"layer {i} keeps {L} past keys but its static ring reads {view} slots: {fix}")
        if i not in self.layers:
            B = self.batch_size
            self.layers[i] = {
                "k": k.new_zeros(B, H, ring, K), "v": k.new_zeros(B, H, ring, K),
                "valid": torch.zeros(B, ring, dtype=torch.bool, device=k.device),
                "next_pos": torch.zeros(B, dtype=torch.long, device=k.device),
                "cursor": torch.zeros(1, dtype=torch.long, device=k.device),
            }
        buf = self.layers[i]
        for name in ("k", "v", "valid", "next_pos"):
            buf[name].zero_()
        buf["k"][:rows, :, :L] = k
        buf["v"][:rows, :, :L] = state["v"]
        buf["valid"][:rows, :L] = state["valid"]
        buf["next_pos"][:rows] = state["next_pos"]
        buf["cursor"].fill_(L)
