"""`TokenLoader`: packed `seq_len` windows from token shards, shuffled by seed, exactly resumable.

The order, in one sentence: the split's shards are one token stream; window `w` is tokens
`[w*T, (w+1)*T)` (the tail shorter than T is dropped); global position `p` reads window
`perm_e(p mod W)` of epoch `e = p // W`, where `perm_e` is a Feistel permutation keyed by (seed, e);
each step consumes `world_size * batch_size` consecutive positions and rank r takes the r-th block of
`batch_size`. The validation split is read in order, one pass, no shuffling.

Consequences:
- The stream is a function of (shards, seed, seq_len) only: every model trained with the same seed sees the
  same tokens in the same order, whatever its mixer.
- Ranks partition each step: over any W consecutive positions every window is read exactly once.
- The state is the global cursor (positions consumed), identical on every rank: `state_dict()` of any rank
  resumes all ranks; the next batch is exactly the one that would have come next.
- Worker count never changes the order (worker k builds steps k, k + n, ...; the DataLoader returns them in
  step order), so `num_workers` may differ on resume.
- Re-sharding rule: a checkpoint from another `world_size`/`batch_size` resumes at the same global cursor
  (nothing skipped, nothing repeated, later steps split differently); since that changes the per-step data,
  it needs `reshard=True`. A changed `seq_len`, `seed` or set of shards has no such rule and is an error.

Batches: `{"input_ids": LongTensor[B, T], "labels": LongTensor[B, T]}` (labels == input_ids; the model shifts).
With `varlen=True`: `input_ids`/`labels` are `[1, B*T]` and `cu_seqlens` is `LongTensor[N+1]`, the start offsets of
the N segments (a segment ends after each EOS and at each window edge), first 0, last B*T.
"""
from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from data.mixing import FeistelPermutation, derive_key
from data.shards import DTYPES, check_shard, data_fingerprint, dtype_for_vocab, read_meta, split_shards
from data.tokenizer import Tokenizer

STATE_FORMAT = "kdn-token-loader"
STATE_VERSION = 1
_SHUFFLE_SALT = 0x53485546  # "SHUF"


class _WindowReader:
    """Reads windows of the concatenated shard stream; memmaps open lazily (cheap to pickle into workers)."""

    def __init__(self, paths: list[Path], sizes: list[int], dtype: str, seq_len: int) -> None:
        self.paths, self.dtype, self.seq_len = paths, dtype, seq_len
        self.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        self._maps: list[np.ndarray] | None = None

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": None}

    def _open(self) -> list[np.ndarray]:
        if self._maps is None:  # plain ndarray views of read-only memory maps (cheaper to slice than np.memmap)
            self._maps = [np.memmap(p, dtype=DTYPES[self.dtype], mode="r").view(np.ndarray) for p in self.paths]
        return self._maps

    def windows(self, index: np.ndarray) -> np.ndarray:
        """Token windows `index` (int array [B]) as an int64 array [B, T]."""
        maps, T = self._open(), self.seq_len
        out = np.empty((len(index), T), dtype=np.int64)
        for row, w in enumerate(index):
            start = int(w) * T
            s = int(np.searchsorted(self.offsets, start, side="right")) - 1
            filled = 0
            while filled < T:  # a window may span several shards
                lo = start + filled - self.offsets[s]
                take = min(T - filled, int(self.offsets[s + 1] - self.offsets[s] - lo))
                out[row, filled:filled + take] = maps[s][lo:lo + take]
                filled += take
                s += 1
        return out


class _Batcher:
    """Builds the batch of one step from the global cursor (pure function of its settings; picklable)."""

    def __init__(self, reader: _WindowReader, num_windows: int, shuffle: bool, seed: int, rank: int,
                 batch_size: int, varlen: bool, eos_id: int) -> None:
        self.reader, self.W, self.shuffle, self.seed = reader, num_windows, shuffle, seed
        self.rank, self.B, self.varlen, self.eos = rank, batch_size, varlen, eos_id
        self._perms: dict[int, FeistelPermutation] = {}

    def window_ids(self, cursor: int) -> np.ndarray:
        """Window indices (int64 [B]) this rank reads at the step starting at global position `cursor`."""
        pos = cursor + self.rank * self.B + np.arange(self.B, dtype=np.int64)
        epoch, j = pos // self.W, pos % self.W
        if not self.shuffle:
            return j
        out = np.empty_like(j)
        for e in np.unique(epoch):
            m = epoch == e
            perm = self._perms.get(int(e))
            if perm is None:
                perm = FeistelPermutation(self.W, derive_key(self.seed, _SHUFFLE_SALT, int(e)))
                self._perms = {int(e): perm}
            out[m] = perm(j[m])
        return out

    def batch(self, cursor: int) -> dict[str, torch.Tensor]:
        """input_ids/labels LongTensor[B, T]; varlen: [1, B*T] plus cu_seqlens LongTensor[N+1]."""
        tokens = torch.from_numpy(self.reader.windows(self.window_ids(cursor)))
        if not self.varlen:
            return {"input_ids": tokens, "labels": tokens.clone()}
        flat = tokens.reshape(1, -1)
        T = tokens.shape[1]
        ends = torch.nonzero(flat[0] == self.eos).flatten() + 1
        edges = torch.arange(0, flat.shape[1] + 1, T)
        cu = torch.unique(torch.cat([edges, ends]))
        return {"input_ids": flat, "labels": flat.clone(), "cu_seqlens": cu}


class _StepStream(torch.utils.data.IterableDataset):
    """DataLoader dataset: worker k of n yields steps k, k+n, ... from `start` (stops after `steps` if given)."""

    def __init__(self, batcher: _Batcher, start: int, stride: int, steps: int | None) -> None:
        self.batcher, self.start, self.stride, self.steps = batcher, start, stride, steps

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        info = torch.utils.data.get_worker_info()
        k, n = (0, 1) if info is None else (info.id, info.num_workers)
        s = k
        while self.steps is None or s < self.steps:
            yield self.batcher.batch(self.start + s * self.stride)
            s += n


class TokenLoader:
    """Iterable of packed batches from a shard directory written by `data.prepare`.

    Args:
        shard_dir: directory with `meta.json`.
        split: "train" (shuffled, endless, resumable) or "val" (in order, one pass per `iter()`).
        seq_len: window length T. batch_size: windows per rank and step (B).
        seed: shuffling seed. rank / world_size: data-parallel position.
        varlen: emit `cu_seqlens` for document-aware training (input_ids then `[1, B*T]`).
        num_workers: DataLoader worker processes building batches (0 = in the calling process).
        pin_memory: pin batch tensors (for asynchronous host-to-device copies).
        verify: check shard SHA-256 checksums at start (each rank checks its share of the shards).
        tokenizer: optional name or `Tokenizer` that must match the shards' tokenizer.
        reshard: allow `load_state_dict` from another world_size / batch_size (see the module docstring).
    """

    def __init__(self, shard_dir: str | os.PathLike, *, split: str = "train", seq_len: int = 4096,
                 batch_size: int, seed: int = 0, rank: int = 0, world_size: int = 1, varlen: bool = False,
                 num_workers: int = 0, pin_memory: bool = False, verify: bool = True,
                 tokenizer: str | Tokenizer | None = None, reshard: bool = False) -> None:
        if seq_len < 2 or batch_size < 1:
            raise ValueError(f"seq_len={seq_len} must be >= 2 and batch_size={batch_size} >= 1")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank={rank} must lie in [0, world_size={world_size})")
        if num_workers < 0:
            raise ValueError(f"num_workers={num_workers} must be >= 0")
        self.shard_dir = Path(shard_dir)
        self.meta = read_meta(self.shard_dir)
        if not self.meta.get("complete"):
            raise ValueError(f"{self.shard_dir} is incomplete (an interrupted prepare); rerun python -m data.prepare "
                             "with the same settings to finish it")
        tok_meta = self.meta["tokenizer"]
        self.vocab_size = int(tok_meta["vocab_size"])
        self.eos_id = int(tok_meta["eos_id"])
        dtype = self.meta["dtype"]
        if dtype not in DTYPES:
            raise ValueError(f"{self.shard_dir}/meta.json names dtype {dtype!r}; expected uint16 or uint32")
        try:
            dtype_for_vocab(self.vocab_size, dtype)
        except ValueError as e:
            raise ValueError(f"{self.shard_dir}/meta.json: {e}; the shards cannot hold this tokenizer's ids, "
                             "prepare them again with dtype=auto") from e
        if tokenizer is not None:
            self._check_tokenizer(tokenizer)
        entries = split_shards(self.meta, split)
        total = sum(e["tokens"] for e in entries)
        if total < seq_len:
            raise ValueError(f"the {split} split of {self.shard_dir} has {total} tokens, fewer than seq_len={seq_len}; "
                             "prepare more data (or a larger val_fraction) or lower seq_len")
        paths = [check_shard(self.shard_dir, e, dtype, checksum=verify and i % world_size == rank)
                 for i, e in enumerate(entries)]
        self.split, self.seq_len, self.batch_size, self.seed = split, seq_len, batch_size, seed
        self.rank, self.world_size, self.varlen = rank, world_size, varlen
        self.num_workers, self.pin_memory, self.reshard = num_workers, pin_memory, reshard
        self.num_windows = total // seq_len
        self.fingerprint = data_fingerprint(self.meta, split)
        reader = _WindowReader(paths, [e["tokens"] for e in entries], dtype, seq_len)
        self._batcher = _Batcher(reader, self.num_windows, split == "train", seed, rank, batch_size, varlen,
                                 self.eos_id)
        self._cursor = 0
        self._generation = 0
        if split == "val" and len(self) == 0:
            raise ValueError(f"the val split has {self.num_windows} windows of {seq_len} tokens, fewer than "
                             f"world_size*batch_size={world_size * batch_size}; lower batch_size or seq_len, or "
                             "prepare with a larger val_fraction")

    def _check_tokenizer(self, tokenizer: str | Tokenizer) -> None:
        want = self.meta["tokenizer"]
        if isinstance(tokenizer, str):
            same = tokenizer == want["name"]
            got = tokenizer
        else:
            same = tokenizer.fingerprint == want["fingerprint"] and tokenizer.vocab_size == want["vocab_size"]
            got = f"{tokenizer.name} (vocab {tokenizer.vocab_size})"
        if not same:
            raise ValueError(f"tokenizer {got} differs from the one {self.shard_dir} was prepared with "
                             f"({want['name']}, vocab {want['vocab_size']}); use that tokenizer or prepare the data "
                             "again with tokenizer=" + (got if isinstance(tokenizer, str) else tokenizer.name))

    @property
    def step_stride(self) -> int:
        """Global positions consumed per step (world_size * batch_size)."""
        return self.world_size * self.batch_size

    @property
    def tokens_per_step(self) -> int:
        """Tokens this rank receives per batch (batch_size * seq_len)."""
        return self.batch_size * self.seq_len

    @property
    def epoch(self) -> float:
        """Passes over the split so far (train)."""
        return self._cursor / self.num_windows

    def __len__(self) -> int:
        """Batches per pass of the val split (the train split is endless)."""
        if self.split == "train":
            raise TypeError("the train TokenLoader is endless; use num_windows / step_stride for batches per epoch")
        return self.num_windows // self.step_stride

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        if self.split == "val":
            return self._iterate(start=0, steps=len(self), advance=False)
        return self._iterate(start=self._cursor, steps=None, advance=True)

    def _iterate(self, start: int, steps: int | None, advance: bool) -> Iterator[dict[str, torch.Tensor]]:
        gen = self._generation
        stride = self.step_stride
        pin = self.pin_memory and torch.cuda.is_available()
        if self.num_workers == 0:
            source = (self._batcher.batch(start + s * stride) for s in range(steps or 1 << 62))
        else:
            source = torch.utils.data.DataLoader(
                _StepStream(self._batcher, start, stride, steps), batch_size=None, num_workers=self.num_workers,
                pin_memory=pin, persistent_workers=False)
        for batch in source:
            if gen != self._generation:  # load_state_dict() was called: this iterator is stale
                return
            if advance:
                self._cursor += stride
            yield {k: v.pin_memory() for k, v in batch.items()} if pin and self.num_workers == 0 else batch

    def state_dict(self) -> dict:
        """Small JSON-able state: the global cursor plus what it depends on."""
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "split": self.split, "cursor": self._cursor,
                "epoch": self._cursor // self.num_windows, "seed": self.seed, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
                "num_windows": self.num_windows, "data": self.fingerprint}

    def load_state_dict(self, state: dict) -> None:
        """Resume at `state["cursor"]`: the next batch is the one that followed the saved state."""
        if state.get("format") != STATE_FORMAT or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_FORMAT} v{STATE_VERSION} state (keys {sorted(state)})")
        for key, fix in (("split", "load the state into a loader of the same split"),
                         ("seq_len", "resume with the saved seq_len (windows differ otherwise)"),
                         ("seed", "resume with the saved seed (the order differs otherwise)")):
            if state[key] != getattr(self, key):
                raise ValueError(f"loader state has {key}={state[key]!r} but this loader has {getattr(self, key)!r}; "
                                 f"{fix}")
        if state["data"] != self.fingerprint or state["num_windows"] != self.num_windows:
            raise ValueError(f"loader state was saved on other shards than {self.shard_dir} ({state['num_windows']} vs "
                             f"{self.num_windows} windows); resume on the same prepared data")
        moved = [k for k in ("world_size", "batch_size") if state[k] != getattr(self, k)]
        if moved and not self.reshard:
            was = ", ".join(f"{k}={state[k]}" for k in moved)
            now = ", ".join(f"{k}={getattr(self, k)}" for k in moved)
            raise ValueError(f"loader state was saved with {was}, this loader has {now}; resume with the saved values, "
                             "or pass reshard=True to continue from the same global window cursor (nothing skipped "
                             "or repeated; later steps are split differently)")
        self._cursor = int(state["cursor"])
        self._generation += 1
