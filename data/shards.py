"""Token shards on disk: raw little-endian uint16/uint32 arrays plus one `meta.json` per directory.

Layout of a shard directory::

    meta.json              format, tokenizer, dtype, source, counts, one entry per chunk of documents
    train-00000.bin ...    token ids of the chunk's training documents, each followed by EOS
    val-00000.bin ...      the chunk's held-out documents (absent when the chunk has none)

Every file is written through `common.write_atomic` (a temp file beside it, renamed when complete), so a crash
never leaves a half shard.
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from common import write_atomic

if TYPE_CHECKING:
    from data.tokenizer import Tokenizer

META = "meta.json"
FORMAT = "kdn-token-shards"
VERSION = 1
SPLITS = ("train", "val")
DTYPES = {"uint16": np.uint16, "uint32": np.uint32}


def dtype_for_vocab(vocab_size: int, requested: str = "auto") -> str:
    """`uint16` when every id fits (vocab_size <= 65536), else `uint32`; checks an explicit request."""
    if requested == "auto":
        return "uint16" if vocab_size <= 1 << 16 else "uint32"
    if requested not in DTYPES:
        raise ValueError(f"dtype={requested!r} is not supported; use auto, uint16 or uint32")
    limit = int(np.iinfo(DTYPES[requested]).max) + 1
    if vocab_size > limit:
        raise ValueError(f"a vocabulary of {vocab_size} ids does not fit {requested} (max {limit}); "
                         "use dtype=auto or dtype=uint32")
    return requested


def sha256_file(path: Path, block: int = 1 << 24) -> str:
    """Hex SHA-256 of a file, read in 16 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def write_array(path: Path, tokens: np.ndarray) -> str:
    """Write `tokens` to `path` via a temp file + fsync + rename; returns its SHA-256."""
    data = np.ascontiguousarray(tokens).tobytes()
    write_atomic(path, data)
    return hashlib.sha256(data).hexdigest()


def write_json(path: Path, obj: dict) -> None:
    """Atomic JSON write (temp file, fsync, rename)."""
    write_atomic(path, json.dumps(obj, indent=1, ensure_ascii=False) + "\n")


def read_meta(shard_dir: str | os.PathLike) -> dict:
    """Load and sanity-check `meta.json` of a shard directory."""
    path = Path(shard_dir) / META
    if not path.is_file():
        raise ValueError(f"{path} does not exist: {shard_dir} is not a prepared shard directory; run "
                         "python -m data.prepare out_dir=DIR first")
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON ({e}); delete the directory and run python -m data.prepare "
                         "again") from e
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise ValueError(f"{path} is not a {FORMAT} v{VERSION} file; prepare the data again with this code")
    return meta


def split_shards(meta: dict, split: str) -> list[dict]:
    """The shard entries (`file`, `tokens`, `documents`, `sha256`) of one split, in stream order."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; use one of {SPLITS}")
    return [c[split] for c in meta["chunks"] if c.get(split)]


def check_shard(shard_dir: Path, entry: dict, dtype: str, checksum: bool) -> Path:
    """Raise a ValueError naming the shard if it is missing, torn, resized or (with checksum) corrupted."""
    path = shard_dir / entry["file"]
    if not path.is_file():
        raise ValueError(f"shard {path} listed in meta.json is missing; rerun python -m data.prepare with the same "
                         "settings to rebuild it")
    size = path.stat().st_size
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    if size % itemsize:
        raise ValueError(f"shard {path} has {size} bytes, not a multiple of {dtype}'s {itemsize}: it is truncated or "
                         "not a token shard; rerun python -m data.prepare with the same settings to rebuild it")
    if size != entry["tokens"] * itemsize:
        raise ValueError(f"shard {path} holds {size // itemsize} tokens but meta.json says {entry['tokens']}; rerun "
                         "python -m data.prepare with the same settings to rebuild it")
    if checksum and sha256_file(path) != entry["sha256"]:
        raise ValueError(f"shard {path} fails its SHA-256 checksum (corrupted copy?); rerun python -m data.prepare "
                         "with the same settings and verify=true (train.py: data.prepare.verify=true) to rebuild it")
    return path


def data_fingerprint(meta: dict, split: str) -> str:
    """SHA-256 over a split's shard checksums: identifies the exact token stream a loader reads."""
    h = hashlib.sha256(split.encode())
    for e in split_shards(meta, split):
        h.update(e["sha256"].encode())
    return h.hexdigest()


def check_tokenizer(shard_dir: str | os.PathLike, tokenizer: Tokenizer) -> dict:
    """Raise a ValueError naming both fingerprints unless ``tokenizer`` is the one the shards were made with
    (same vocabulary fingerprint, size and EOS id); returns the shards' ``meta.json``."""
    meta = read_meta(shard_dir)
    want, got = meta["tokenizer"], tokenizer.describe()
    keys = ("fingerprint", "vocab_size", "eos_id")
    if any(want.get(k) != got[k] for k in keys):
        def show(t: dict) -> str:
            return f"{t.get('name')} (vocab {t.get('vocab_size')}, fingerprint {str(t.get('fingerprint'))[:16]})"

        raise ValueError(f"tokenizer {show(got)} is not the one {shard_dir} was prepared with, {show(want)}; load "
                         f"that tokenizer, or prepare the data again with tokenizer={got['name']}")
    return meta
