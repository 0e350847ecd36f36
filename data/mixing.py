"""Stateless integer hashing and a keyed permutation (pure 64-bit arithmetic, identical on every machine).

`FeistelPermutation(n, key)` maps `[0, n)` onto itself bijectively in O(1) memory: a balanced Feistel
network over the smallest even number of bits that covers `n`, with cycle walking back into range. It
shuffles training windows without storing a permutation array (50B tokens / 4096 = 12M windows).
"""
from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MUL1 = np.uint64(0xBF58476D1CE4E5B9)
_MUL2 = np.uint64(0x94D049BB133111EB)


def _mix(z: np.ndarray) -> np.ndarray:
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _MUL1
    z = (z ^ (z >> np.uint64(27))) * _MUL2
    return z ^ (z >> np.uint64(31))


def splitmix64(x: np.ndarray | int) -> np.ndarray:
    """SplitMix64 finaliser of uint64 values (wrapping arithmetic); returns a uint64 array of x's shape."""
    with np.errstate(over="ignore"):
        return _mix(np.asarray(x, dtype=np.uint64))


def derive_key(*parts: int) -> int:
    """One 64-bit key from integers (e.g. seed, epoch), each folded in with SplitMix64."""
    h = np.uint64(0x243F6A8885A308D3)
    for p in parts:
        h = splitmix64(h ^ np.uint64(int(p) & 0xFFFFFFFFFFFFFFFF))[()]
    return int(h)


def uniform01(index: np.ndarray, key: int) -> np.ndarray:
    """Deterministic uniform floats in [0, 1) for integer indices, float64 array of index's shape."""
    h = splitmix64(np.asarray(index, dtype=np.uint64) ^ np.uint64(key))
    return (h >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


class FeistelPermutation:
    """A keyed bijection of `[0, n)`; `perm(np.arange(n))` is a permutation of `np.arange(n)`."""

    def __init__(self, n: int, key: int, rounds: int = 6) -> None:
        if n < 1:
            raise ValueError(f"FeistelPermutation needs n >= 1, got {n}")
        bits = max(2, (n - 1).bit_length())
        bits += bits % 2
        self.n = n
        self._half = np.uint64(bits // 2)
        self._mask = np.uint64((1 << (bits // 2)) - 1)
        self._keys = [np.uint64(derive_key(key, r)) for r in range(rounds)]

    def _round_trip(self, x: np.ndarray) -> np.ndarray:
        left, right = x >> self._half, x & self._mask
        with np.errstate(over="ignore"):
            for k in self._keys:
                left, right = right, left ^ (_mix(right ^ k) & self._mask)
        return (left << self._half) | right

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """Images of indices `x` (int array, values in [0, n)); int64 array of x's shape."""
        y = self._round_trip(np.asarray(x, dtype=np.uint64))
        out = y >= np.uint64(self.n)
        while out.any():  # cycle walking: stays a bijection of [0, n)
            y[out] = self._round_trip(y[out])
            out = y >= np.uint64(self.n)
        return y.astype(np.int64)
