"""Table 2: the modified RULER grid (docs/protocol.md §9) on a loaded model.

The samples come from :mod:`eval.ruler` (each derived from its own seed, so every model sees the same ones); the
prompts of a cell are decoded greedily in length-sorted, left-padded batches over the model's cache
(:func:`eval.generation.greedy_generate`), at most ``max_new_tokens`` tokens, stopping at EOS. A cell's score is
RULER's ``string_match_all`` (x100); the summary is the equal-weight mean over the cells run. With
``batch_size=auto`` on CUDA, the cells of one context length share one :class:`eval.generation.BatchSearch`, which
sizes their batches in place (at most a cell's samples each); every cell records the rows of its batches.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from eval.generation import BatchSearch, greedy_generate
from eval.model_dir import check_context
from eval.results import load_previous, sha256_text
from eval.ruler.haystack import Haystack
from eval.suites import Context, run_cells

log = logging.getLogger("evaluate")


@dataclass
class RulerOptions:
    """``ruler``: Table 2 (modified RULER, eval/ruler)."""

    tasks: list[str] = field(default_factory=lambda: ["niah_single_1", "niah_single_2", "niah_single_3",
                                                      "niah_multikey_1"])
    lengths: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])  # each task runs the lengths of
    # its grid that are listed here
    samples_per_cell: int = 500
    seed: int = 0
    haystack: str = field(default="kjv", metadata={"help": "kjv, essays, hub:<dataset>, or a .json or text file"})
    max_new_tokens: int = 128


def ruler_cells(tasks: list[str], lengths: list[int]) -> list[tuple[str, int]]:
    """``(task, length)`` of the grid restricted to ``tasks`` and ``lengths``; unknown names are refused."""
    from eval import ruler

    bad = [t for t in tasks if t not in ruler.TASKS]
    if bad:
        raise ValueError(f"unknown RULER task(s) {bad}: use {list(ruler.TASKS)}")
    cells = [(t, n) for t in tasks for n in ruler.GRID[t] if n in lengths]
    known = {n for t in tasks for n in ruler.GRID[t]}
    extra = sorted(set(lengths) - known)
    if extra:
        raise ValueError(f"RULER length(s) {extra} are in no selected task's grid "
                         f"({ {t: list(ruler.GRID[t]) for t in tasks} }): drop them from ruler.lengths")
    if not cells:
        raise ValueError("ruler.tasks x ruler.lengths selects no cell")
    return cells


def load_ruler_haystack(cfg: RulerOptions) -> Haystack:
    """The essay haystack ``ruler.haystack`` names; called before any model is loaded, so that essays that cannot
    be reached stop the run with one line naming the fixes (a local file, or ``ruler.haystack=kjv``)."""
    from eval import ruler

    try:
        return ruler.load_haystack(cfg.haystack)
    except ValueError as e:
        raise type(e)(f"ruler.haystack={cfg.haystack}: {e}") from None


def run_ruler(ctx: Context, cfg: RulerOptions) -> dict[str, Any]:
    """Run the selected cells (``ruler.tasks`` x ``ruler.lengths``, ``ruler.samples_per_cell`` each); a cell is
    written as soon as it finishes.

    The settings record ``haystack`` (``{"name", "source", "sha256", "paper"}``), ``lengths`` (the cells' token
    budgets: prompt + ``max_new_tokens`` <= length), ``max_new_tokens`` and ``batch_size`` (an int or ``"auto"``);
    lm-eval's ``max_length`` plays no part. A cell records ``batch_sizes``, the rows of each of its batches in
    decoding order (longest prompts first), which is how its prompts were grouped.
    """
    from eval import ruler

    cells = ruler_cells(list(cfg.tasks), [int(n) for n in cfg.lengths])
    for task, length in cells:
        check_context(length, ctx.attention_limit, f"RULER cell {ruler.cell_name(task, length)}")
    haystack = load_ruler_haystack(cfg)
    tok = ctx.hf_tokenizer
    eos = tok.eos_token_id if tok.eos_token_id is not None else ctx.model.config.eos_token_id
    pad = tok.pad_token_id if tok.pad_token_id is not None else eos
    n = int(cfg.samples_per_cell)
    by_name = {ruler.cell_name(t, length): (t, length) for t, length in cells}
    settings = {"lengths": sorted({length for _, length in cells}), "samples_per_cell": n, "seed": int(cfg.seed),
                "tokenizer": str(ctx.target.hf_dir), "tokenizer_sha256": ctx.tokenizer.fingerprint,
                "haystack": haystack.describe(), "max_new_tokens": int(cfg.max_new_tokens),
                "batch_size": ctx.batch_size, "dtype": ctx.dtype, "tasks": {t: ruler.VERSIONS[t] for t in cfg.tasks},
                "cells": list(by_name)}
    done = load_previous(ctx.target.out_dir / "ruler.json", settings, ctx.overwrite, ctx.weights)
    todo = [name for name in by_name if name not in done]
    bar = tqdm(total=n * len(todo), desc="ruler", unit="sample", disable=not ctx.progress, dynamic_ncols=True)
    searches: dict[int, BatchSearch] = {}  # batch_size=auto: one per context length, for this run

    def batches(length: int) -> int | BatchSearch:
        if isinstance(ctx.batch_size, int):
            return ctx.batch_size
        if length not in searches:
            searches[length] = BatchSearch(cap=n)
        return searches[length]

    def run_cell(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        task, length = by_name[name]
        samples = ruler.build_samples(task, length, n, tokenizer=ctx.tokenizer, haystack=haystack,
                                      seed=int(cfg.seed), max_new_tokens=int(cfg.max_new_tokens))
        prompts = [tok(s["prompt"])["input_ids"] for s in samples]
        bar.set_postfix_str(name)
        sizes: list[int] = []

        def counted(rows: int) -> None:
            sizes.append(rows)
            bar.update(rows)

        plan = batches(length)
        searching = isinstance(plan, BatchSearch) and not plan.done
        gens = greedy_generate(ctx.model, prompts, max_new_tokens=int(cfg.max_new_tokens), stop_ids={eos},
                               pad_id=pad, batch_size=plan, on_batch=counted)
        if searching and plan.done:
            rates = ", ".join(f"{b}: {r:.1f}" for b, r in sorted(plan.rates.items()))
            log.info(f"ruler: batches of {plan.size} for the {length}-token cells (samples/s by batch: {rates})")
        preds = [ruler.postprocess(tok.decode(g, skip_special_tokens=True)) for g in gens]
        refs = [s["answers"] for s in samples]
        rows = [{"index": s["index"], "prompt_sha256": sha256_text(s["prompt"]), "answers": s["answers"],
                 "prediction": p, "score": ruler.string_match_all([p], [s["answers"]]), "depth": s["depth"],
                 "prompt_tokens": len(ids)} for s, p, ids in zip(samples, preds, prompts)]
        return {"score": ruler.string_match_all(preds, refs), "n": len(samples),
                "mean_prompt_tokens": sum(map(len, prompts)) / len(prompts), "batch_sizes": sizes}, rows

    def summarize(res: dict[str, Any]) -> dict[str, Any]:  # every cell in the file, this run's and earlier ones
        scores = [r["score"] for r in res.values()]
        return {"mean": sum(scores) / len(scores), "cells": len(scores)} if scores else {"cells": 0}

    try:
        return run_cells(ctx, "ruler", settings, list(by_name), run_cell, summarize, bar=False)
    finally:
        bar.close()
