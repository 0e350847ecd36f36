"""Write one RULER cell's samples as JSON lines.

    python -m eval.ruler.generate task=niah_single_2 length=4096 n=20 out=FILE.jsonl \
        [seed=0] [start=0] [haystack=kjv|essays|PATH] [tokenizer=mistral-v1] [max_new_tokens=128]

`haystack` takes what `ruler.haystack` takes (`eval.ruler.haystack.load_haystack`); the paper's is `essays` or
RULER's `PaulGrahamEssays.json`. One line per sample with the fields of `build_samples` (task, length, index,
prompt, answers, depth, haystack_words, prompt_tokens, ...). The file is written to a temporary name and renamed
when complete.
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from common.options import from_dict, parse_options
from eval.ruler.haystack import load_haystack
from eval.ruler.samples import MAX_NEW_TOKENS, build_samples, cell_name, check_task


@dataclass
class GenerateOptions:
    """The command's ``key=value`` options (``common.options``); the first four have no default."""

    task: str
    length: int
    n: int
    out: str
    seed: int = 0
    start: int = 0
    haystack: str = "kjv"
    tokenizer: str = "mistral-v1"
    max_new_tokens: int = MAX_NEW_TOKENS


def parse_args(argv: list[str]) -> GenerateOptions:
    """``key=value`` arguments as :class:`GenerateOptions`; an unknown key (with a did-you-mean), a missing one or
    a value not of its type is a one-line ``ValueError``."""
    values, _ = parse_options(GenerateOptions, argv, example="task=niah_single_2 length=4096 n=20 out=FILE.jsonl")
    return from_dict(GenerateOptions, values)


def write_jsonl(samples: list[dict], out: str | os.PathLike) -> Path:
    """Write `samples` as JSON lines to `out` atomically (temporary file, then rename)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for s in samples:
            f.write(json.dumps(s, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def main(argv: list[str] | None = None) -> Path:
    """Generate and write one cell's samples; returns the output path."""
    from data.tokenizer import load_tokenizer

    args = parse_args(sys.argv[1:] if argv is None else argv)
    spec = check_task(args.task)
    t0 = time.perf_counter()
    haystack = load_haystack(args.haystack) if spec.haystack == "essay" else None
    tokenizer = load_tokenizer(args.tokenizer)
    samples = build_samples(args.task, args.length, args.n, tokenizer=tokenizer, haystack=haystack, seed=args.seed,
                            start=args.start, max_new_tokens=args.max_new_tokens)
    path = write_jsonl(samples, args.out)
    words = [s["haystack_words"] for s in samples] or [0]
    tokens = [s["prompt_tokens"] for s in samples] or [0]
    print(f"{cell_name(args.task, args.length)}: wrote {len(samples)} samples to {path} "
          f"(haystack {min(words)}-{max(words)} words, prompts {min(tokens)}-{max(tokens)} tokens, "
          f"{time.perf_counter() - t0:.1f} s)")
    return path


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")
