"""The evaluation suites behind ``evaluate.py``: ``lm`` (Table 1), ``retrieval`` (Table 3), ``ppl`` (held-out
shard perplexity), ``beta_eff`` (the overwrite probe); ``ruler`` (Table 2) is in :mod:`eval.ruler_suite`.

Every suite is a list of cells (lm-eval tasks, retrieval tasks, RULER cells, shard splits) run by
:func:`run_cells`, which merges each finished cell into ``<out_dir>/<suite>.json`` and skips the cells an earlier
or concurrent run with the same settings on the same weights finished or is computing.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common.device import device_name
from eval.harness import (
    ACC_METRIC,
    Unavailable,
    evaluate_task,
    load_task,
    make_lm,
    table1_row,
    task_manager,
)
from eval.model_dir import Target, check_context
from eval.results import ResultsFile, SampleLog, suite_payload

log = logging.getLogger("evaluate")
RETRIEVAL_TASKS = ("swde", "fda", "squad", "triviaqa", "nq", "drop")
LM_SUMMARY_KEYS = ("wiki_ppl", "lmb_ppl", *ACC_METRIC, "avg")


@dataclass
class LmOptions:
    """``lm``: Table 1 (lm-eval, zero-shot)."""

    tasks: list[str] = field(default_factory=lambda: ["wikitext", "lambada_openai", "piqa", "hellaswag", "winogrande",
                                                      "arc_easy", "arc_challenge"])
    limit: int | None = None  # at most this many documents per task
    include_path: str | None = None  # a folder of extra lm-eval task YAMLs


@dataclass
class RetrievalOptions:
    """``retrieval``: Table 3 (cloze retrieval, eval/tasks)."""

    tasks: list[str] = field(default_factory=lambda: list(RETRIEVAL_TASKS))
    data_dir: str | None = None  # a folder of <task>.jsonl / .parquet with the hub datasets' fields (offline)
    context_tokens: int = 2048
    limit: int | None = None


@dataclass
class PplOptions:
    """``ppl``: held-out perplexity on data.prepare shards."""

    shards: str | None = None
    split: str = "val"
    seq_len: int = 2048
    max_batches: int | None = None


@dataclass
class BetaEffOptions:
    """``beta_eff``: the overwrite probe (Fig. 2)."""

    shards: str | None = None
    n_seqs: int = 8
    seq_len: int = 2048


@dataclass
class Context:
    """A loaded model and what every suite needs to know about it."""

    target: Target
    model: Any
    hf_tokenizer: Any  # transformers tokenizer of the export (lm-eval, generation)
    tokenizer: Any  # data.Tokenizer of the same vocabulary (RULER's token counts)
    device: torch.device
    dtype: str
    max_length: int  # lm-eval's context (default: the training context)
    attention_limit: int | None  # a full-attention model's trained context, else None
    model_meta: dict[str, Any]
    weights: dict[str, Any]  # eval.model_dir.weights_identity of what was loaded: {"sha256", "files"}
    batch_size: int | str = 8  # "auto" (CUDA): each suite sizes its own batches (eval.generation.resolve_batch_size)
    overwrite: bool = False
    log_samples: bool = False
    skip_unavailable: bool = False
    progress: bool = True
    skipped: dict[str, str] = field(default_factory=dict)  # "suite/cell" -> why it did not run


def run_cells(ctx: Context, suite: str, settings: dict[str, Any], cells: list[str],
              run_cell: Callable[[str], tuple[dict[str, Any], list[dict[str, Any]]]],
              summarize: Callable[[dict[str, Any]], dict[str, Any]], unit: str = "cell",
              bar: bool = True) -> dict[str, Any]:
    """Run the unfinished ``cells`` of ``suite`` in order, merging each into the results file as it finishes.

    ``run_cell(cell)`` -> ``(result, per-sample rows)``; a cell whose data is unreachable raises
    :class:`Unavailable`, which is recorded in ``ctx.skipped`` when ``ctx.skip_unavailable`` (else re-raised).
    Cells finished on other weights (``ctx.weights``) are computed again; with ``ctx.overwrite`` every cell is, and
    the file's other cells stay. A cell that another evaluation of this model is computing is skipped, then waited
    for at the end (and computed here if that evaluation died first). ``bar=False`` leaves the progress bar to the
    suite (RULER counts samples). Returns the results file as it stands at the end."""
    store = ResultsFile(ctx.target.out_dir, suite, settings, ctx.weights)
    samples = SampleLog(ctx.target.out_dir / f"{suite}.samples.jsonl", ctx.log_samples)
    before = store.start(ctx.overwrite)
    todo = list(cells) if ctx.overwrite else [c for c in cells if c not in before]
    if len(todo) < len(cells):
        log.info(f"{suite}: {len(cells) - len(todo)} of {len(cells)} {unit}s already in {store.path}")
    t0 = time.perf_counter()

    def payload(done: dict[str, Any], merged: dict[str, Any]) -> dict[str, Any]:
        ordered = {c: done[c] for c in cells if c in done} | {c: v for c, v in done.items() if c not in cells}
        return suite_payload(suite, ctx.model_meta, ctx.weights, merged, ordered, summarize(ordered),
                             time.perf_counter() - t0, device_name(ctx.device))

    def compute(cell: str) -> None:
        now = store.cells()
        if cell in now and (cell not in before or now[cell] != before[cell]):
            return  # finished by another evaluation since this one started
        try:
            result, rows = run_cell(cell)
        except Unavailable as e:
            if not ctx.skip_unavailable:
                raise
            ctx.skipped[f"{suite}/{cell}"] = str(e)
            log.warning(f"{suite}: skipped {cell}: {e}")
            return
        store.add(cell, result, rows, samples, payload)

    busy = []
    for cell in tqdm(todo, desc=suite, unit=unit, disable=not (ctx.progress and bar and todo), dynamic_ncols=True):
        with store.claim(cell) as held:
            if held:
                compute(cell)
            else:
                busy.append(cell)
    for cell in busy:
        log.info(f"{suite}: waiting for {cell}, which another evaluation of this model is computing")
        with store.claim(cell, wait=True):
            compute(cell)
    return store.read() or payload({}, settings)


def run_lm(ctx: Context, cfg: LmOptions) -> dict[str, Any]:
    """Table 1: lm-eval tasks through ``HFLM`` at ``ctx.max_length``; summary in Table 1's columns."""
    check_context(ctx.max_length, ctx.attention_limit, f"lm-eval at max_length={ctx.max_length}")
    manager = task_manager(cfg.include_path, defaults=False)  # indexing lm-eval's own tasks takes a minute
    if any(name not in manager.all_tasks for name in cfg.tasks):
        manager = task_manager(cfg.include_path)
    lm = make_lm(ctx.model, ctx.hf_tokenizer, batch_size=ctx.batch_size, max_length=ctx.max_length)
    tasks = list(cfg.tasks)
    versions: dict[str, Any] = {}

    def run_cell(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        task = load_task(manager, name)
        versions[name] = _task_version(task)
        metrics, samples = evaluate_task(lm, task, manager, limit=cfg.limit, log_samples=ctx.log_samples)
        return metrics[name], samples.get(name, [])

    unknown = [n for n in tasks if n not in manager.all_tasks]
    if unknown:  # before any model call
        raise ValueError(f"unknown lm-eval task(s) {unknown}; see `lm_eval ls tasks`, or add their YAML folder "
                         "with lm.include_path=DIR")
    settings = {"max_length": ctx.max_length, "limit": cfg.limit, "batch_size": ctx.batch_size, "dtype": ctx.dtype,
                "tokenizer": str(ctx.target.hf_dir), "tokenizer_sha256": ctx.tokenizer.fingerprint,
                "num_fewshot": 0, "tasks": versions}
    return run_cells(ctx, "lm", settings, tasks, run_cell,
                     lambda res: {k: v for k, v in table1_row(res).items() if k in LM_SUMMARY_KEYS}, unit="task")


def _task_version(task: dict[str, Any]) -> Any:
    obj = next(iter(task.values()))
    return getattr(obj, "VERSION", None) or (getattr(obj.config, "metadata", None) or {}).get("version")


def run_retrieval(ctx: Context, cfg: RetrievalOptions) -> dict[str, Any]:
    """Table 3: the six cloze tasks (``eval/tasks/kdn_<task>.yaml``); score = % of documents whose greedy
    continuation contains an answer; summary = the six-task mean."""
    unknown = [t for t in cfg.tasks if t not in RETRIEVAL_TASKS]
    if unknown:
        raise ValueError(f"unknown retrieval task(s) {unknown}: use {list(RETRIEVAL_TASKS)}")
    from eval.tasks import MAX_GEN_TOKENS, TRUNCATION, VERSIONS, prompt_budget

    context = int(cfg.context_tokens)
    prompt_budget(context)  # a window too small for any document stops here, before the model runs
    check_context(context + MAX_GEN_TOKENS, ctx.attention_limit, f"retrieval at context_tokens={context}")
    metadata = {"tokenizer": str(ctx.target.hf_dir), "context_tokens": context,
                "data_dir": str(Path(cfg.data_dir).expanduser()) if cfg.data_dir else None}
    manager = task_manager(None, metadata, defaults=False)
    # the prompts are cut to `context - MAX_GEN_TOKENS` tokens already: HFLM must not cut them again
    lm = make_lm(ctx.model, ctx.hf_tokenizer, batch_size=ctx.batch_size, max_length=context + MAX_GEN_TOKENS)
    # known before any cell runs, so that a cell of an earlier definition (an older results file) is not reused
    versions: dict[str, Any] = {t: VERSIONS[t] for t in cfg.tasks}

    def run_cell(name: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        task = load_task(manager, f"kdn_{name}")
        versions[name] = _task_version(task)
        metrics, samples = evaluate_task(lm, task, manager, limit=cfg.limit, log_samples=ctx.log_samples)
        m = metrics[f"kdn_{name}"]
        return ({"score": 100 * m["contains"], "n": m["n"], "batch_size": m["batch_size"]},
                samples.get(f"kdn_{name}", []))

    def summarize(res: dict[str, Any]) -> dict[str, Any]:
        done = [res[t]["score"] for t in RETRIEVAL_TASKS if t in res]
        return {"mean": sum(done) / len(done)} if len(done) == len(RETRIEVAL_TASKS) else {}

    settings = {"max_length": context + MAX_GEN_TOKENS, "context_tokens": context, "truncation": TRUNCATION,
                "limit": cfg.limit,
                "max_new_tokens": MAX_GEN_TOKENS, "batch_size": ctx.batch_size, "dtype": ctx.dtype,
                "tokenizer": str(ctx.target.hf_dir), "tokenizer_sha256": ctx.tokenizer.fingerprint,
                "data_dir": metadata["data_dir"], "tasks": versions}
    return run_cells(ctx, "retrieval", settings, list(cfg.tasks), run_cell, summarize, unit="task")


def run_ppl(ctx: Context, cfg: PplOptions) -> dict[str, Any]:
    """Held-out perplexity on prepared shards (``ppl.shards``): token-weighted loss and its exp per split."""
    from eval.perplexity import shard_perplexity

    if not cfg.shards:
        raise ValueError("suite ppl needs ppl.shards=<a data.prepare output directory>, e.g. "
                         "ppl.shards=data/cache/embedded-kjv-mistral-v1")
    check_context(cfg.seq_len, ctx.attention_limit, f"ppl at seq_len={cfg.seq_len}")

    def run_cell(split: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return shard_perplexity(ctx.model, cfg.shards, split=split, seq_len=cfg.seq_len,
                                max_batches=cfg.max_batches), []

    settings = {"shards": str(cfg.shards), "split": cfg.split, "seq_len": cfg.seq_len,
                "max_batches": cfg.max_batches, "dtype": ctx.dtype, "tokenizer_sha256": ctx.tokenizer.fingerprint}
    return run_cells(ctx, "ppl", settings, [cfg.split], run_cell,
                     lambda res: {f"{s}_ppl": r["ppl"] for s, r in res.items()}, unit="split")


def run_beta_eff(ctx: Context, cfg: BetaEffOptions) -> dict[str, Any]:
    """The overwrite probe (Fig. 2): ``beta_eff`` statistics on ``beta_eff.n_seqs`` validation sequences, and a
    histogram PNG beside the results file."""
    from eval.overwrite import plot, probe_beta_eff, summarize

    if not cfg.shards:
        raise ValueError("suite beta_eff needs beta_eff.shards=<a data.prepare output directory>")

    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        betas = probe_beta_eff(ctx.model, cfg.shards, n_seqs=cfg.n_seqs, seq_len=cfg.seq_len)
        ctx.target.out_dir.mkdir(parents=True, exist_ok=True)
        plot(betas, ctx.target.out_dir / "beta_eff.png")
        return summarize(betas), []

    settings = {"shards": str(cfg.shards), "n_seqs": cfg.n_seqs, "seq_len": cfg.seq_len, "dtype": ctx.dtype}
    return run_cells(ctx, "beta_eff", settings, ["probe"], run_cell,
                     lambda res: {k: res["probe"]["pooled"][k] for k in ("mean", "q50", "overwrite_share")}
                     if "probe" in res else {})
