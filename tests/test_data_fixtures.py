"""Fixture builders shared by the data tests: synthetic English-like documents in FineWeb-Edu files."""
from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from data import PrepareConfig, prepare, read_meta
from data.shards import split_shards

_WORDS = ("the of and to in is that for it as was with be by on not he this are or his from at which but have an "
          "they you were her she there been one all we their has would when if so no what up out who them some "
          "could into time other than then its only two more these may first any new very my such like over also "
          "water light school river energy student teacher history number people learning science cell plant "
          "mountain library question answer example theory method result system protein climate ocean planet "
          "café naïve façade über résumé").split()


def make_docs(n: int, seed: int = 0, min_words: int = 5, max_words: int = 120) -> list[str]:
    """`n` unique documents of prose-like text (words, numbers, punctuation, paragraphs, some accents)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(min_words, max_words))]
        parts = [f"Document {i} ({seed}):"]
        for j, w in enumerate(words):
            parts.append(w.capitalize() if j % 11 == 0 else w)
            if j % 17 == 16:
                parts.append(f"{rng.randint(0, 9999)}.")
            if j % 29 == 28:
                parts.append("\n\n")
        docs.append(" ".join(parts).replace(" \n\n ", ".\n\n"))
    return docs


def write_parquet(path: Path, docs: list[str], row_group_size: int = 7, first_id: int = 0) -> Path:
    """A parquet file with the FineWeb-Edu schema (text, id, dump, url, ..., score, int_score)."""
    n = len(docs)
    table = pa.table({
        "text": docs,
        "id": [f"<urn:uuid:{first_id + i:08d}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{first_id + i}" for i in range(n)],
        "file_path": ["s3://commoncrawl/fake.warc.gz"] * n,
        "language": ["en"] * n,
        "language_score": np.linspace(0.9, 0.99, n),
        "token_count": [len(d.split()) for d in docs],
        "score": np.linspace(2.5, 4.5, n),
        "int_score": [3] * n,
    })
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_jsonl(path: Path, docs: list[str], key: str = "text") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({key: d, "id": i}) + "\n" for i, d in enumerate(docs)), encoding="utf-8")
    return path


def prepared(tmp: Path, n_docs: int = 120, **overrides) -> tuple[Path, list[str]]:
    """Prepare `n_docs` synthetic documents from two parquet files; returns (shard_dir, documents)."""
    docs = make_docs(n_docs)
    half = n_docs // 2
    write_parquet(tmp / "src" / "part-0.parquet", docs[:half])
    write_parquet(tmp / "src" / "part-1.parquet", docs[half:], first_id=half)
    settings = {"source": "parquet", "paths": str(tmp / "src" / "*.parquet"), "out_dir": str(tmp / "shards"),
                "docs_per_shard": 16, "val_fraction": 0.2, "num_workers": 1, "progress": False, **overrides}
    return prepare(PrepareConfig(**settings)), docs


def split_tokens(shard_dir: Path, split: str) -> np.ndarray:
    """All tokens of a split, in stream order (int64)."""
    meta = read_meta(shard_dir)
    dtype = np.dtype(meta["dtype"])
    parts = [np.fromfile(shard_dir / e["file"], dtype=dtype) for e in split_shards(meta, split)]
    return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, dtype=np.int64)
