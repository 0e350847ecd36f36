"""Multi-query associative recall (MQAR, Zoology), generated on the fly from a seed.

A sequence of ``seq_len`` tokens starts with ``pairs`` key-value pairs ``k1 v1 k2 v2 ...``: keys are drawn without
replacement from ``[1, vocab/2)`` (unique within a sequence), values without replacement from ``[vocab/2, vocab)``.
The rest of the sequence (``seq_len - 2 pairs`` tokens, seen as ``space = (seq_len - 2 pairs) / 2`` slots of two
tokens) holds one query per key: the key sits at the first token of slot ``g``, where the ``pairs`` slots are drawn
without replacement with probability ``p(g) ∝ (g + 1)^(power_a - 1)`` (a power law: most queries come soon after
the context, a few far away). Every other token of that region is uniform over the whole vocabulary. The label of
a query position is its key's value (the model predicts it on reading the key); every other label is ``-100``.

Examples are generated in blocks of :data:`GEN_BLOCK` sequences, block ``j`` of a split from its own seed, so a
split is a fixed, finite set of examples that needs no file and reads the same on any device.
"""
from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cached_property, lru_cache

import torch
from torch import Tensor

IGNORE = -100
SPLITS = {"train": 0, "valid": 1, "test": 2}


@dataclass(frozen=True)
class MQARSetting:
    """One task shape: ``seq_len`` tokens holding ``pairs`` key-value pairs and their ``pairs`` queries."""

    seq_len: int
    pairs: int
    vocab_size: int = 8192
    power_a: float = 0.01

    def __post_init__(self) -> None:
        if self.seq_len % 2:
            raise ValueError(f"seq_len must be even (queries sit in two-token slots), got {self.seq_len}")
        if self.pairs < 1 or 4 * self.pairs > self.seq_len:
            raise ValueError(f"{self.pairs} pairs need 4 * pairs <= seq_len (context and queries), got seq_len "
                             f"{self.seq_len}; use fewer pairs or a longer sequence")
        if self.vocab_size // 2 - 1 < self.pairs or self.vocab_size <= self.seq_len:
            raise ValueError(f"vocab_size {self.vocab_size} is too small for {self.pairs} unique keys and "
                             f"seq_len {self.seq_len}; use a vocabulary larger than both")
        if not 0 < self.power_a <= 1:
            raise ValueError(f"power_a must be in (0, 1] (1: uniform gaps), got {self.power_a}")

    @property
    def name(self) -> str:
        """``{seq_len}x{pairs}``, e.g. ``64x4``."""
        return f"{self.seq_len}x{self.pairs}"

    @classmethod
    def parse(cls, name: str, vocab_size: int = 8192, power_a: float = 0.01) -> MQARSetting:
        """``"512x64"`` -> ``MQARSetting(512, 64)``."""
        try:
            seq_len, pairs = (int(x) for x in name.split("x"))
        except ValueError:
            raise ValueError(f"a setting is written SEQLENxPAIRS (e.g. 64x4), got {name!r}") from None
        return cls(seq_len, pairs, vocab_size, power_a)

    @property
    def context(self) -> int:
        """Tokens of the key-value prefix."""
        return 2 * self.pairs

    @cached_property
    def gap_probs(self) -> Tensor:
        """``[space]``: the power law over query slots."""
        space = (self.seq_len - self.context) // 2
        g = torch.arange(1, space + 1, dtype=torch.float64)
        p = self.power_a * g ** (self.power_a - 1)
        return (p / p.sum()).float()


def block_seed(seed: int, split: str, setting: MQARSetting, block: int) -> int:
    """The generator seed of one block: a hash of everything that names it (stable across runs and machines)."""
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {list(SPLITS)}")
    text = f"mqar/{seed}/{split}/{setting.name}/{setting.vocab_size}/{setting.power_a}/{block}"
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") & (2**63 - 1)


def generate(setting: MQARSetting, n: int, seed: int) -> tuple[Tensor, Tensor]:
    """``n`` MQAR sequences from ``seed`` (CPU). Returns ``inputs [n, T]`` and ``labels [n, T]`` (int64), where
    ``labels[:, t]`` is the value to predict at position ``t`` (on reading a query key) or ``-100``."""
    g = torch.Generator().manual_seed(seed)
    T, P, V = setting.seq_len, setting.pairs, setting.vocab_size
    half = V // 2
    keys = torch.rand(n, half - 1, generator=g).topk(P, dim=1).indices + 1  # unique keys in [1, V/2)
    values = torch.rand(n, V - half, generator=g).topk(P, dim=1).indices + half  # unique values in [V/2, V)
    inputs = torch.randint(0, V, (n, T), generator=g)
    inputs[:, 0:setting.context:2] = keys
    inputs[:, 1:setting.context:2] = values
    probs = setting.gap_probs.expand(n, -1)
    slots = torch.multinomial(probs, P, replacement=False, generator=g)  # [n, P] distinct slots
    positions = setting.context + 2 * slots
    inputs.scatter_(1, positions, keys)
    labels = torch.full((n, T), IGNORE, dtype=torch.int64)
    labels.scatter_(1, positions, values)
    return inputs, labels


GEN_BLOCK = 256
"""Examples per generation block: a split is blocks ``0, 1, ...`` of this many sequences, so its content does not
depend on the batch size that trains or scores it."""


@lru_cache(maxsize=64)
def _split_tensors(setting: MQARSetting, split: str, n: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Blocks ``0 .. ceil(n / GEN_BLOCK) - 1`` of a split, cut to ``n`` examples: ``inputs [n, T]`` (int32),
    ``positions [n, P]`` (int64, ascending) and ``values [n, P]`` (int64). Cached: a worker trains many models on
    one split."""
    xs, ys = zip(*(generate(setting, GEN_BLOCK, block_seed(seed, split, setting, j))
                   for j in range(-(-n // GEN_BLOCK))))
    inputs, labels = torch.cat(xs)[:n], torch.cat(ys)[:n]
    positions = (labels != IGNORE).nonzero()[:, 1].view(n, setting.pairs)
    return inputs.int(), positions, labels.gather(1, positions)


class MQARSplit:
    """A fixed split of ``n`` examples of one setting, scored or trained in batches of ``batch`` examples.

    The examples are blocks of :data:`GEN_BLOCK` sequences, block ``j`` from :func:`block_seed` ``(seed, split,
    setting, j)``. ``batches`` yields ``(inputs [b, T], positions [b, P], values [b, P])`` on a device: the answers
    are ``values[i, p]`` at ``inputs[i, positions[i, p]]``, every sequence having exactly ``P`` of them, so the
    loss needs no boolean mask (and no host synchronisation).
    """

    def __init__(self, setting: MQARSetting, split: str, n: int, batch: int, seed: int = 0) -> None:
        if n < 1 or batch < 1:
            raise ValueError(f"a split needs n >= 1 examples and batch >= 1, got n={n}, batch={batch}")
        block_seed(seed, split, setting, 0)  # validates the split name
        self.setting, self.split, self.n, self.batch, self.seed = setting, split, n, batch, seed
        self._on: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def __len__(self) -> int:
        """Batches per pass: ``ceil(n / batch)``."""
        return -(-self.n // self.batch)

    def tensors(self, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
        """All examples on ``device``: ``inputs [n, T]`` (int32), ``positions [n, P]``, ``values [n, P]``; copied
        there once per split."""
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = tuple(t.to(device) for t in _split_tensors(self.setting, self.split, self.n,
                                                                           self.seed))
        return self._on[device]

    def take(self, idx: Tensor, device: torch.device | str = "cpu") -> tuple[Tensor, Tensor, Tensor]:
        """Examples ``idx [b]`` on ``device``: ``inputs [b, T]`` (int64), ``positions [b, P]``, ``values [b, P]``."""
        inputs, positions, values = self.tensors(device)
        idx = idx.to(inputs.device, non_blocking=True)
        return inputs[idx].long(), positions[idx], values[idx]

    def labels(self) -> Tensor:
        """``[n, T]``: the value at each answer position, ``-100`` elsewhere (the form :func:`generate` returns)."""
        inputs, positions, values = self.tensors()
        return torch.full(inputs.shape, IGNORE, dtype=torch.int64).scatter_(1, positions, values)

    def order(self, epoch: int) -> Tensor:
        """``[n]``: the example order of one training pass, drawn from ``(seed, epoch)``."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(self.n, generator=g)

    def batches(self, device: torch.device | str = "cpu", order: Tensor | None = None
                ) -> Iterator[tuple[Tensor, Tensor, Tensor]]:
        """Every example once, in ``order`` (default: stored order), as ``batch``-sized :meth:`take` results on
        ``device`` (the last batch may be smaller). The order is copied to the device once, not a batch at a time:
        a copy from pageable host memory waits for the device's queue to drain."""
        device = self.tensors(device)[0].device
        order = torch.arange(self.n, device=device) if order is None else order.to(device)
        for chunk in order.split(self.batch):
            yield self.take(chunk, device)
