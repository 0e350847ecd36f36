"""FineWeb-Edu (or an offline corpus) to packed, resumable token batches.

Public interface (`TokenLoader` is imported lazily, so tokeniser worker processes never load torch):
- `load_tokenizer(name_or_path="mistral-v1") -> Tokenizer`
- `PrepareConfig`, `prepare(cfg) -> Path` (CLI: `python -m data.prepare key=value ...`)
- `TokenLoader(shard_dir, *, split, seq_len, batch_size, seed, rank, world_size, varlen)`
- `read_meta(shard_dir) -> dict`, `check_tokenizer(shard_dir, tokenizer) -> dict` (refuses another tokenizer)
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from data.pipeline import PrepareConfig, prepare
from data.shards import check_tokenizer, read_meta
from data.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from data.loader import TokenLoader

__all__ = ["PrepareConfig", "TokenLoader", "Tokenizer", "check_tokenizer", "load_tokenizer", "prepare", "read_meta"]


def __getattr__(name: str) -> Any:
    if name == "TokenLoader":  # imports torch: only when asked for
        return importlib.import_module("data.loader").TokenLoader
    raise AttributeError(f"module 'data' has no attribute {name!r}")
