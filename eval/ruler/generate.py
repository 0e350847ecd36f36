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
from pathlib import Path

from eval.ruler.haystack import load_haystack
from eval.ruler.samples import MAX_NEW_TOKENS, build_samples, cell_name, check_task

_REQUIRED = ("task", "length", "n", "out")
_DEFAULTS = {"seed": "0", "start": "0", "haystack": "kjv", "tokenizer": "mistral-v1",
             "max_new_tokens": str(MAX_NEW_TOKENS)}
_INTS = ("length", "n", "seed", "start", "max_new_tokens")


def parse_args(argv: list[str]) -> dict:
    """`key=value` arguments as a dict (ints converted); unknown or missing keys are refused."""
    args: dict = dict(_DEFAULTS)
    for item in argv:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"argument {item!r} is not key=value; e.g. task=niah_single_2 length=4096 n=20 "
                             "out=FILE.jsonl")
        if key not in _REQUIRED and key not in _DEFAULTS:
            raise ValueError(f"unknown argument {key!r}; known: {', '.join((*_REQUIRED, *_DEFAULTS))}")
        args[key] = value
    missing = [k for k in _REQUIRED if k not in args]
    if missing:
        raise ValueError(f"missing {', '.join(m + '=' for m in missing)}; e.g. task=niah_single_2 length=4096 "
                         "n=20 out=FILE.jsonl")
    for key in _INTS:
        try:
            args[key] = int(args[key])
        except ValueError:
            raise ValueError(f"{key}={args[key]!r} is not an integer") from None
    return args


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
    spec = check_task(args["task"])
    t0 = time.perf_counter()
    haystack = load_haystack(args["haystack"]) if spec.haystack == "essay" else None
    tokenizer = load_tokenizer(args["tokenizer"])
    samples = build_samples(args["task"], args["length"], args["n"], tokenizer=tokenizer, haystack=haystack,
                            seed=args["seed"], start=args["start"], max_new_tokens=args["max_new_tokens"])
    path = write_jsonl(samples, args["out"])
    words = [s["haystack_words"] for s in samples] or [0]
    tokens = [s["prompt_tokens"] for s in samples] or [0]
    print(f"{cell_name(args['task'], args['length'])}: wrote {len(samples)} samples to {path} "
          f"(haystack {min(words)}-{max(words)} words, prompts {min(tokens)}-{max(tokens)} tokens, "
          f"{time.perf_counter() - t0:.1f} s)")
    return path


if __name__ == "__main__":
    try:
        main()
    except ValueError as e:
        sys.exit(f"error: {e}")
