"""A decoding cache: one dict of tensors per layer index, plus the number of tokens seen."""
from __future__ import annotations

from typing import Any


class RecurrentCache:
    """Per-layer decoding state. Recurrent layers store ``{"recurrent": ..., "conv": ...}``;
    attention layers store their (window-bounded) keys and values. Models may subclass it."""

    def __init__(self) -> None:
        self.layers: dict[int, dict[str, Any]] = {}
        self.seen_tokens = 0

    def get(self, layer_idx: int) -> dict[str, Any] | None:
        return self.layers.get(layer_idx)

    def update(self, layer_idx: int, **state: Any) -> None:
        self.layers.setdefault(layer_idx, {}).update(state)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen_tokens

    def __len__(self) -> int:
        return len(self.layers)
