"""Tokenise a document source into binary token shards (`prepare`; CLI `python -m data.prepare key=value ...`).

Examples::

    python -m data.prepare                                   # embedded corpus, mistral-v1 -> data/cache/...
    python -m data.prepare source=hub dataset_config=sample-100BT max_tokens=50B out_dir=/scratch/fwe
    python -m data.prepare source=parquet paths='/data/fineweb-edu/sample/10BT/*.parquet' num_workers=32

Stream convention: every document is followed by EOS (`doc EOS doc EOS ...`); with `add_bos=true` each
document is also preceded by BOS. The default is no BOS, which matches lm-eval's rolling log-likelihood
(it conditions the first token on EOS). Empty (whitespace-only) documents are skipped and counted.

Documents are cut into chunks of `docs_per_shard` records; chunk k becomes `train-k.bin` and `val-k.bin`.
A document goes to validation when a hash of (seed, its index in the source) falls below `val_fraction`,
so the split depends neither on the worker count nor on the budget. `max_tokens` caps training tokens
exactly (the last document is cut). A rerun resumes after the last finished chunk; a changed budget keeps
the untruncated chunks that fit and recomputes the rest. A kept chunk whose shard is missing or resized
(with `verify=true`: fails its SHA-256) is tokenised again, and must reproduce its recorded checksums.
"""
from __future__ import annotations

import dataclasses
import errno
import faulthandler
import multiprocessing as mp
import os
import re
import sys
import time
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from itertools import chain, islice
from pathlib import Path

import numpy as np

from common.options import parse_options
from data.mixing import derive_key, uniform01
from data.shards import DTYPES, FORMAT, META, VERSION, check_shard, dtype_for_vocab, read_meta, write_array, write_json
from data.sources import FINEWEB_EDU, SOURCES, DocumentSource, make_source
from data.tokenizer import DEFAULT_TOKENIZER, Tokenizer, load_tokenizer

_VAL_SALT = 0x56414C  # "VAL"
# files prepare writes, and the temp files of their atomic writes (``NAME.<pid>.<hex>.tmp``; ``NAME.<pid>.tmp`` of
# earlier versions)
_OWN_FILE = re.compile(r"^((train|val)-\d{5}\.bin|meta\.json)(\.\d+(\.[0-9a-f]+)?\.tmp)?$")
_ENCODE_BATCH = 512
FILE_SOURCES = ("parquet", "jsonl", "text")  # the sources that read `paths=`
MIN_VAL_TOKENS = 10_000  # below this a validation loss is mostly noise (about ten 1K-token windows)


@dataclass
class PrepareConfig:
    """Settings of `prepare` (every field is a `key=value` override on the command line)."""

    source: str = "embedded"  # embedded | hub | parquet | jsonl | text
    paths: str = ""  # comma-separated globs for parquet / jsonl / text
    dataset: str = FINEWEB_EDU  # hub dataset
    dataset_config: str = "sample-10BT"  # hub config, e.g. sample-10BT, sample-100BT
    dataset_split: str = "train"
    text_key: str = "text"  # parquet column / jsonl field / hub field
    tokenizer: str = DEFAULT_TOKENIZER  # "mistral-v1" (offline) or a Hugging Face name / path
    out_dir: str = ""  # default: data/cache/<source>-<tokenizer>
    max_tokens: int = 0  # training-token budget; 0 = the whole source
    val_fraction: float | None = None  # share of documents held out; None = 0.02 embedded, else 0.005
    seed: int = 0  # picks the validation documents
    docs_per_shard: int = 50_000
    num_workers: int = 0  # tokeniser processes; 0 = one per CPU core
    dtype: str = "auto"  # auto | uint16 | uint32
    add_bos: bool = False  # also put BOS before every document
    overwrite: bool = False  # rebuild the directory from scratch (also when it was prepared with other settings)
    verify: bool = False  # check every kept shard's SHA-256 (else its size) and rebuild the chunks that fail
    progress: bool = True


def default_out_dir(cfg: PrepareConfig) -> Path:
    """`data/cache/<source tag>-<tokenizer tag>` under the working directory."""
    if cfg.source == "hub":
        tag = f"{cfg.dataset.split('/')[-1]}-{cfg.dataset_config}"
    elif cfg.source == "embedded":
        tag = "embedded-kjv"
    else:
        import hashlib

        tag = f"{cfg.source}-{hashlib.sha256(cfg.paths.encode()).hexdigest()[:8]}"
    tok = re.sub(r"[^A-Za-z0-9._-]+", "_", cfg.tokenizer.strip("/").split("/")[-1])
    return Path("data/cache") / f"{tag}-{tok}"


def _file_source_for(paths: str) -> str:
    """The file source that reads `paths`, guessed from the first glob's extension."""
    first = paths.split(",")[0].strip().lower()
    if first.endswith(".parquet"):
        return "parquet"
    if first.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    return "text"


def _validate(cfg: PrepareConfig) -> None:
    if cfg.source not in SOURCES:
        raise ValueError(f"unknown source={cfg.source!r}; choose one of {', '.join(SOURCES)}")
    if cfg.paths.strip() and cfg.source not in FILE_SOURCES:
        guess = _file_source_for(cfg.paths)
        raise ValueError(f"paths={cfg.paths!r} is read only by source={'|'.join(FILE_SOURCES)}, but source is "
                         f"{cfg.source!r}; add source={guess} (e.g. python -m data.prepare source={guess} "
                         f"paths='{cfg.paths}')")
    if cfg.val_fraction is not None and not 0.0 <= cfg.val_fraction < 1.0:
        raise ValueError(f"val_fraction={cfg.val_fraction} must lie in [0, 1)")
    if cfg.docs_per_shard < 1:
        raise ValueError(f"docs_per_shard={cfg.docs_per_shard} must be >= 1")
    if cfg.max_tokens < 0:
        raise ValueError(f"max_tokens={cfg.max_tokens} must be >= 0 (0 = no budget)")
    if cfg.num_workers < 0:
        raise ValueError(f"num_workers={cfg.num_workers} must be >= 0 (0 = one per core)")


# ---------------------------------------------------------------- worker side (one tokenizer per process)
_TOKENIZER: Tokenizer | None = None


def _init_worker(tokenizer: Tokenizer) -> None:
    global _TOKENIZER
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    faulthandler.enable()  # a worker that crashes leaves its traceback on stderr
    _TOKENIZER = tokenizer


def _pack(docs: list[list[int]], bos: int | None, eos: int, dtype: str) -> np.ndarray:
    """Concatenate `[bos] doc [eos]` for each document into one array of `dtype`."""
    pre = [] if bos is None else [bos]
    total = sum(len(d) for d in docs) + len(docs) * (1 + len(pre))
    return np.fromiter(chain.from_iterable(chain(pre, d, (eos,)) for d in docs), dtype=DTYPES[dtype], count=total)


def _tokenize_chunk(task: dict) -> dict:
    """Tokenise one chunk of documents and write its train/val shards; returns their entries."""
    tok = _TOKENIZER
    texts: list[str] = task["texts"]
    first = task["first_document"]
    keep = [i for i, t in enumerate(texts) if t and not t.isspace()]
    ids: list[list[int]] = []
    for s in range(0, len(keep), _ENCODE_BATCH):
        ids.extend(tok.encode_batch([texts[i] for i in keep[s:s + _ENCODE_BATCH]]))
    index = np.asarray(keep, dtype=np.int64) + first
    is_val = uniform01(index, task["val_key"]) < task["val_fraction"]
    bos = tok.bos_id if task["add_bos"] else None
    out: dict = {"index": task["index"], "first_document": first, "documents": len(texts),
                 "skipped_empty": len(texts) - len(keep), "truncated": False}
    for split, mask in (("train", ~is_val), ("val", is_val)):
        docs = [d for d, m in zip(ids, mask) if m]
        lengths = np.asarray([len(d) for d in docs], dtype=np.int64) + (2 if bos is not None else 1)
        out[f"{split}_doc_index"] = index[mask]
        out[f"{split}_doc_tokens"] = lengths
        if not docs:
            out[split] = None
            continue
        name = f"{split}-{task['index']:05d}.bin"
        arr = _pack(docs, bos, tok.eos_id, task["dtype"])
        out[split] = {"file": name, "tokens": int(arr.size), "documents": len(docs),
                      "sha256": write_array(Path(task["out_dir"]) / name, arr)}
    return out


# ---------------------------------------------------------------- main process
def _content_identity(tok: Tokenizer, source: DocumentSource, cfg: PrepareConfig, dtype: str) -> dict:
    return {"tokenizer": tok.describe(), "dtype": dtype, "add_bos": cfg.add_bos, "separator": "eos",
            "source": source.describe(),
            "settings": {"val_fraction": cfg.val_fraction, "seed": cfg.seed, "docs_per_shard": cfg.docs_per_shard}}


def _truncate(out_dir: Path, res: dict, remaining: int) -> dict:
    """Cut a chunk so that it holds exactly `remaining` training tokens (0 < remaining < its train tokens)."""
    itemsize_dtype = np.dtype(DTYPES[res["dtype"]])
    cum = np.cumsum(res["train_doc_tokens"])
    k = int(np.searchsorted(cum, remaining))  # the document where the budget is reached
    cut_doc = int(res["train_doc_index"][k])
    entry = res["train"]
    path = out_dir / entry["file"]
    entry.update(tokens=int(remaining), documents=k + 1,
                 sha256=write_array(path, np.fromfile(path, dtype=itemsize_dtype)[:remaining]))
    keep_val = res["val_doc_index"] < cut_doc
    if res["val"] is not None:
        n_val = int(res["val_doc_tokens"][keep_val].sum())
        vpath = out_dir / res["val"]["file"]
        if n_val == 0:
            vpath.unlink()
            res["val"] = None
        elif n_val < res["val"]["tokens"]:
            res["val"].update(tokens=n_val, documents=int(keep_val.sum()),
                              sha256=write_array(vpath, np.fromfile(vpath, dtype=itemsize_dtype)[:n_val]))
    res["documents"] = cut_doc - res["first_document"] + 1
    res["skipped_empty"] = res["documents"] - (k + 1) - int(keep_val.sum())
    res["truncated"] = True
    return res


def _chunk_entry(res: dict) -> dict:
    return {k: res[k] for k in ("index", "first_document", "documents", "skipped_empty", "truncated", "train", "val")}


def _recount(meta: dict) -> None:
    chunks = meta["chunks"]
    meta["counts"] = {
        "train_tokens": sum(c["train"]["tokens"] for c in chunks if c["train"]),
        "val_tokens": sum(c["val"]["tokens"] for c in chunks if c["val"]),
        "train_documents": sum(c["train"]["documents"] for c in chunks if c["train"]),
        "val_documents": sum(c["val"]["documents"] for c in chunks if c["val"]),
        "source_documents": sum(c["documents"] for c in chunks),
        "skipped_empty": sum(c["skipped_empty"] for c in chunks),
    }


def _clean_stray(out_dir: Path, chunks: list[dict]) -> None:
    """Delete temp files and shards that no kept chunk lists (from an interrupted or pruned run)."""
    keep = {c[s]["file"] for c in chunks for s in ("train", "val") if c[s]} | {META}
    for f in out_dir.iterdir():
        if _OWN_FILE.match(f.name) and f.name not in keep:
            f.unlink()


def _resume_state(out_dir: Path, identity: dict, cfg: PrepareConfig) -> tuple[list[dict], list[dict], bool, bool]:
    """Chunks of a previous run that stay valid, those of them whose shards are damaged (to rebuild), whether it
    read the whole source, and whether it is complete with this exact budget (then there is nothing to write)."""
    if not (out_dir / META).exists():
        return [], [], False, False
    if cfg.overwrite:
        _clean_stray(out_dir, [])
        (out_dir / META).unlink()
        return [], [], False, False
    meta = read_meta(out_dir)
    diff = [k for k, v in identity.items() if meta.get(k) != v]
    if diff:
        raise ValueError(f"{out_dir} was prepared with different {', '.join(diff)} (tokenizer/source/settings differ "
                         f"from this run); use another out_dir=, or overwrite=true to rebuild it")
    chunks, damaged, budget = [], [], cfg.max_tokens or None
    total = 0
    for c in meta["chunks"]:
        n = c["train"]["tokens"] if c["train"] else 0
        if c["truncated"] and meta.get("max_tokens") != cfg.max_tokens:
            break
        if budget is not None and total + n > budget:
            break
        problems = []
        for split in ("train", "val"):
            if c[split]:
                try:
                    check_shard(out_dir, c[split], meta["dtype"], checksum=cfg.verify)
                except ValueError as e:
                    problems.append(str(e).split(";")[0])
        if problems:
            print(f"prepare: {'; '.join(problems)}: tokenising chunk {c['index']} again", file=sys.stderr)
            if c["truncated"]:  # the budget's last chunk: recomputed with everything after it
                break
            damaged.append(c)
        chunks.append(c)
        total += n
    unchanged = len(chunks) == len(meta["chunks"])
    return chunks, damaged, bool(meta.get("exhausted")) and unchanged, (
        unchanged and not damaged and bool(meta.get("complete")) and meta.get("max_tokens") == cfg.max_tokens)


def _task_base(cfg: PrepareConfig, dtype: str, out_dir: Path) -> dict:
    """The fields every `_tokenize_chunk` task shares."""
    return {"out_dir": str(out_dir), "dtype": dtype, "add_bos": cfg.add_bos, "val_fraction": cfg.val_fraction,
            "val_key": derive_key(cfg.seed, _VAL_SALT)}


def _rebuild(cfg: PrepareConfig, tok: Tokenizer, source: DocumentSource, dtype: str, out_dir: Path,
             chunk: dict) -> None:
    """Tokenise one untruncated chunk again (its shards are rewritten); its checksums must match `meta.json`."""
    texts = list(islice(source.documents(chunk["first_document"]), chunk["documents"]))
    _init_worker(tok)
    res = _tokenize_chunk({**_task_base(cfg, dtype, out_dir), "index": chunk["index"],
                           "first_document": chunk["first_document"], "texts": texts})
    for split in ("train", "val"):
        got, want = (None if e is None else e["sha256"] for e in (res[split], chunk[split]))
        if got != want:
            raise ValueError(f"chunk {chunk['index']} of {out_dir} tokenised again differs from its meta.json entry "
                             "(the source changed since); rebuild the directory with overwrite=true")


def prepare(cfg: PrepareConfig) -> Path:
    """Tokenise `cfg.source` into shards under `cfg.out_dir`; idempotent and resumable.

    Returns the shard directory (with `meta.json`, `train-*.bin`, `val-*.bin`). One process prepares a
    directory at a time; once it is complete, further calls only read it (several ranks may call this).
    """
    _validate(cfg)
    if cfg.val_fraction is None:
        cfg = dataclasses.replace(cfg, val_fraction=0.02 if cfg.source == "embedded" else 0.005)
    tok = load_tokenizer(cfg.tokenizer)
    dtype = dtype_for_vocab(tok.vocab_size, cfg.dtype)
    source = make_source(cfg.source, paths=cfg.paths, text_key=cfg.text_key, dataset=cfg.dataset,
                         dataset_config=cfg.dataset_config, dataset_split=cfg.dataset_split)
    source.validate()
    out_dir = Path(cfg.out_dir) if cfg.out_dir else default_out_dir(cfg)
    identity = _content_identity(tok, source, cfg, dtype)
    out_dir.mkdir(parents=True, exist_ok=True)
    chunks, damaged, exhausted, finished = _resume_state(out_dir, identity, cfg)
    for chunk in damaged:
        _rebuild(cfg, tok, source, dtype, out_dir, chunk)
    if finished:  # read-only: safe for several processes (e.g. ranks after the main one prepared)
        return out_dir
    meta = {"format": FORMAT, "version": VERSION, "complete": False, **identity, "max_tokens": cfg.max_tokens,
            "budget_reached": False, "exhausted": False, "chunks": chunks}
    _clean_stray(out_dir, chunks)
    _recount(meta)
    budget = cfg.max_tokens or None
    train_total = meta["counts"]["train_tokens"]
    done = exhausted or (budget is not None and train_total >= budget)
    if not done:
        _run(cfg, tok, source, dtype, out_dir, meta, budget)
    _recount(meta)
    if meta["counts"]["train_tokens"] == 0:
        raise ValueError(f"the source produced no training tokens (all {meta['counts']['source_documents']} "
                         "documents empty or held out); check text_key= and val_fraction=")
    meta["complete"] = True
    meta["budget_reached"] = budget is not None and meta["counts"]["train_tokens"] >= budget
    write_json(out_dir / META, meta)
    if cfg.val_fraction > 0 and (warning := small_val_warning(meta, cfg)):
        print(f"prepare: warning: {out_dir}: {warning}", file=sys.stderr)
    return out_dir


def small_val_warning(meta: dict, cfg: PrepareConfig) -> str | None:
    """One line when the validation split of a prepared directory is empty or under `MIN_VAL_TOKENS`, else None."""
    c = meta["counts"]
    if c["val_tokens"] >= MIN_VAL_TOKENS:
        return None
    per = {"text": " (source=text makes one document per file)", "jsonl": " (one per line)"}.get(cfg.source, "")
    held = (f"is empty: none of the {c['source_documents']:,} documents was held out" if c["val_tokens"] == 0 else
            f"holds only {c['val_tokens']:,} tokens ({c['val_documents']:,} of {c['source_documents']:,} documents)")
    return (f"the validation split {held} at val_fraction={cfg.val_fraction}, too few for a meaningful validation "
            f"loss; give more documents{per} or raise val_fraction=")


def _run(cfg: PrepareConfig, tok: Tokenizer, source: DocumentSource, dtype: str, out_dir: Path, meta: dict,
         budget: int | None) -> None:
    """Tokenise chunks from where `meta` stops, updating meta.json after each finished chunk."""
    from tqdm.auto import tqdm

    chunks = meta["chunks"]
    next_doc = chunks[-1]["first_document"] + chunks[-1]["documents"] if chunks else 0
    next_index = chunks[-1]["index"] + 1 if chunks else 0
    workers = cfg.num_workers or len(os.sched_getaffinity(0))
    docs = source.documents(next_doc)
    base = _task_base(cfg, dtype, out_dir)
    if cfg.add_bos and tok.bos_id is None:
        raise ValueError(f"add_bos=true but tokenizer {tok.name!r} has no BOS token; use add_bos=false")
    # fork (Linux) starts workers instantly and never re-imports __main__; the workers touch no CUDA or threads.
    # An executor, not a Pool: a worker that dies breaks it (BrokenProcessPool) where a Pool waits forever for the
    # lost chunk
    ctx = mp.get_context("fork" if "fork" in mp.get_all_start_methods() else "spawn")
    pool = ProcessPoolExecutor(workers, ctx, _init_worker, (tok,)) if workers > 1 else None
    bar = tqdm(total=budget, initial=meta["counts"]["train_tokens"], unit="tok", unit_scale=True,
               disable=not cfg.progress, dynamic_ncols=True, desc=f"prepare {out_dir.name}")
    if pool is None:
        _init_worker(tok)
    pending: deque = deque()
    t0, n_docs, finished = time.perf_counter(), 0, False

    def finish(res: dict) -> bool:
        nonlocal n_docs
        res["dtype"] = dtype
        have = sum(c["train"]["tokens"] for c in chunks if c["train"])
        n_train = res["train"]["tokens"] if res["train"] else 0
        hit = budget is not None and have + n_train >= budget
        if budget is not None and have + n_train > budget:
            res = _truncate(out_dir, res, budget - have)
        chunks.append(_chunk_entry(res))
        _recount(meta)
        try:
            write_json(out_dir / META, meta)
        except OSError:  # meta.json still lists the chunks before this one: its shards go with the stray files
            chunks.pop()
            raise
        n_docs += res["documents"]
        bar.update(meta["counts"]["train_tokens"] - bar.n)
        bar.set_postfix_str(f"{n_docs / (time.perf_counter() - t0):,.0f} docs/s")
        return hit

    try:
        while not finished:
            texts = list(islice(docs, cfg.docs_per_shard))
            if not texts:
                meta["exhausted"] = True
                break
            task = {**base, "index": next_index, "first_document": next_doc, "texts": texts}
            next_index += 1
            next_doc += len(texts)
            if pool is None:
                finished = finish(_tokenize_chunk(task))
                continue
            pending.append(pool.submit(_tokenize_chunk, task))
            while len(pending) >= 2 * workers or (pending and pending[0].done()):
                finished = finish(pending.popleft().result())
                if finished:
                    break
        while pending and not finished:
            finished = finish(pending.popleft().result())
    except BrokenProcessPool:
        raise RuntimeError(f"a tokeniser process of prepare {out_dir} died (its traceback, if any, is above); "
                           "rerun the same command to continue from the last finished chunk") from None
    finally:
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        bar.close()
        _clean_stray(out_dir, chunks)


def config_from_overrides(overrides: list[str]) -> PrepareConfig:
    """`PrepareConfig` from Hydra-style `key=value` strings, read by `common.options.parse_options` (an unknown key
    or a value not of its field's type is a one-line `OptionError`, a `ValueError`)."""
    values, _ = parse_options(PrepareConfig, overrides, example="max_tokens=50M")
    return PrepareConfig(**values)


def os_error_line(e: OSError) -> str:
    """One line naming the file, the system's reason and the fix of an OSError raised while preparing."""
    where = f"{e.filename}: " if e.filename else ""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        fix = "free space there or pass out_dir= on a disk with room"
    elif e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        fix = "pass an out_dir= you can write to (or fix the permissions)"
    else:
        fix = "fix the cause"
    return (f"{where}{e.strerror or e}; {fix}, then run the same command again (finished chunks are kept, nothing "
            "half-written is)")


def main(argv: list[str] | None = None) -> int:
    """CLI entry: parse overrides, prepare, print a summary; returns the exit status (2 on bad input)."""
    argv = sys.argv[1:] if argv is None else argv
    if any(a in ("-h", "--help") for a in argv):
        print(__doc__)
        for f in dataclasses.fields(PrepareConfig):
            print(f"  {f.name}={f.default!r}")
        return 0
    try:
        cfg = config_from_overrides(argv)
        out = prepare(cfg)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # a full disk, a read-only or foreign directory: one line, the finished chunks kept
        print(f"error: {os_error_line(e)}", file=sys.stderr)
        return 1
    meta = read_meta(out)
    c = meta["counts"]
    print(f"{out}: {c['train_tokens']:,} train tokens / {c['train_documents']:,} docs, {c['val_tokens']:,} val "
          f"tokens / {c['val_documents']:,} docs, {meta['dtype']}, tokenizer {meta['tokenizer']['name']}")
    return 0

