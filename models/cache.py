"""The decoding cache of :class:`models.KDNForCausalLM`, usable by ``transformers``' ``generate``."""
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
