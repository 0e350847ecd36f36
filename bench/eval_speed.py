"""Evaluation speed: the full RULER grid, the cloze suite and Table-1-shaped lm-eval requests for a random-weight
model (default: the 750M Diagonal KDN in bf16 on CUDA), at evaluate.py's default batch sizes (``auto``).

    python -m bench.eval_speed                       # H200: prints a table, writes bench/results/eval_speed.json
    python -m bench.eval_speed --parts ruler         # the RULER grid alone (14 cells x 500 samples, 128 tokens)
    python -m bench.eval_speed --size toy --samples-per-cell 2 --cloze-docs 2 --lm-scale 0.001 --out /tmp/x.json

Random weights never stop early, so every RULER prompt decodes all 128 tokens and every cloze prompt all 48: the
times are upper bounds for a trained model. Each part reports its wall time and where it goes (sample building,
prefill forwards, one-token decode forwards). The cloze documents are synthetic, each at the 2,048-token cap the
suite truncates to; the lm-eval requests have the test splits' document counts with typical context lengths
(``LM_SHAPES``, approximate lengths). ``--batch-size auto`` sizes the RULER batches as the suite does (one
:class:`eval.generation.BatchSearch` per context length, in place); each cell records its batches, and the report
gives each length's search (samples/s by batch size). The RULER part's ``wall_s`` (sample building included, model
loading not) is the number to compare with the grid's time budget. Before the parts, one batch of two short prompts
runs the process's first forwards and decoding steps (``--warmup``, on by default): what they compile (sliding-window
attention's ``flex_attention``, compiled once with dynamic shapes) and load is timed there, as the header's
``warmup_s``, and stays out of the parts' times.
"""
from __future__ import annotations

import argparse
import random
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

import models
from common.device import device_name
from data import load_tokenizer
from eval.generation import AUTO, BatchSearch, greedy_generate, resolve_batch_size
from eval.harness import batch_used, make_lm
from eval.results import versions
from trainer.checkpoint import write_json_atomic

# task -> (documents, choices per document, context tokens, continuation tokens); counts of the splits lm-eval
# scores, lengths approximate. wikitext: 62 documents of ~5,700 tokens, scored in rolling windows.
LM_SHAPES = {"lambada_openai": (5153, 1, 80, 2), "piqa": (1838, 2, 30, 25), "hellaswag": (10042, 4, 70, 30),
             "winogrande": (1267, 2, 25, 8), "arc_easy": (2376, 4, 35, 6), "arc_challenge": (1172, 4, 40, 7)}
WIKITEXT_DOCS, WIKITEXT_TOKENS = 62, 5700
CLOZE_TASKS = ("swde", "fda", "squad", "triviaqa", "nq", "drop")
OUT = Path(__file__).parent / "results" / "eval_speed.json"


class ForwardClock:
    """Wall time of a model's prefills (backbone forwards over more than one token) and, inside :meth:`part`, the
    rest: the decoding steps. These are CUDA-graph replays under :func:`models.generate`, which no forward hook
    sees, so decode time is a block's wall time less its prefills."""

    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.device, self.prefill_s, self._t0 = device, 0.0, None
        backbone = getattr(model, "model", model)
        backbone.register_forward_pre_hook(self._pre, with_kwargs=True)
        backbone.register_forward_hook(self._post, with_kwargs=True)

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _capturing(self) -> bool:
        return self.device.type == "cuda" and torch.cuda.is_current_stream_capturing()

    def _pre(self, mod: Any, args: tuple, kwargs: dict) -> None:
        x = next((kwargs[k] for k in ("input_ids", "inputs_embeds") if kwargs.get(k) is not None),
                 args[0] if args else None)
        self._t0 = None
        if x is not None and x.shape[1] > 1 and not self._capturing():
            self._sync()
            self._t0 = time.perf_counter()

    def _post(self, mod: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if self._t0 is not None:
            self._sync()
            self.prefill_s += time.perf_counter() - self._t0
            self._t0 = None

    @contextmanager
    def part(self, into: dict[str, float]) -> Iterator[None]:
        """Add the block's prefill time and its other (decode) time to ``into``."""
        before, t0 = self.prefill_s, time.perf_counter()
        self._sync()
        yield
        self._sync()
        prefill = self.prefill_s - before
        into["prefill_s"] = into.get("prefill_s", 0.0) + prefill
        into["decode_s"] = into.get("decode_s", 0.0) + time.perf_counter() - t0 - prefill


def _filler(tok: Any, n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, tok.vocab_size) for _ in range(n)]


def warm_up(model: Any, tok: Any, eos: int, lengths: tuple[int, int] = (300, 200), new_tokens: int = 4) -> float:
    """Seconds of one batch of random prompts of ``lengths`` tokens decoding ``new_tokens`` each: a process's first
    prefill and decoding steps, with whatever they compile."""
    rng = random.Random(0)
    t0 = time.perf_counter()
    greedy_generate(model, [_filler(tok, n, rng) for n in lengths], max_new_tokens=new_tokens, stop_ids={eos},
                    pad_id=eos, batch_size=len(lengths))
    if next(model.parameters()).is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def bench_ruler(model: Any, tok: Any, clock: ForwardClock, cells: list[str], n: int, batch_size: int | str,
                eos: int, new_tokens: int = 128, haystack: str | None = None,
                on_cell: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Every cell: build ``n`` samples (eval.ruler, on ``haystack``: default the KJV), decode them as the ruler
    suite does (``batch_size="auto"``: a :class:`BatchSearch` per context length, capped at ``n``). ``on_cell``
    receives the finished cells' rows after each cell (a run stopped mid-grid keeps them)."""
    from eval import ruler

    hay = ruler.load_haystack(haystack)
    searches: dict[int, BatchSearch] = {}
    rows, t_all = {}, time.perf_counter()
    for cell in cells:
        task, length = cell.split("@")
        t0 = time.perf_counter()
        samples = ruler.build_samples(task, int(length), n, tokenizer=tok, haystack=hay)
        built = time.perf_counter() - t0
        prompts = [tok.encode(s["prompt"]) for s in samples]
        row: dict[str, Any] = {"samples": n, "build_s": built,
                                 "prompt_tokens_mean": sum(map(len, prompts)) / len(prompts)}
        if batch_size == AUTO and int(length) not in searches:
            searches[int(length)] = BatchSearch(cap=n)
        plan = searches[int(length)] if batch_size == AUTO else batch_size
        sizes: list[int] = []
        t1 = time.perf_counter()
        with clock.part(row):
            greedy_generate(model, prompts, max_new_tokens=new_tokens, stop_ids={eos}, pad_id=eos,
                            batch_size=plan, on_batch=sizes.append)
        row["generate_s"] = time.perf_counter() - t1
        row["batch_sizes"] = sizes
        rows[cell] = row
        print(f"  ruler {cell:<22} {row['generate_s']:8.1f} s  ({n / row['generate_s']:.1f} samples/s, "
              f"batches {sorted(set(sizes), reverse=True)})", flush=True)
        if on_cell is not None:
            on_cell({"cells": rows, "complete": False})
    total = time.perf_counter() - t_all
    return {"cells": rows, "complete": True, "samples": n * len(cells), "wall_s": total,
            "samples_per_s": n * len(cells) / total, "haystack": hay.describe()["name"],
            "searches": {str(length): {"batch_size": s.size, "done": s.done,
                                       "samples_per_s": {str(b): r for b, r in sorted(s.rates.items())}}
                         for length, s in sorted(searches.items())},
            **{k: sum(r[k] for r in rows.values()) for k in ("build_s", "prefill_s", "decode_s")}}


def _hflm(model: Any, hf_tok: Any, batch_size: int | str, max_length: int) -> Any:
    return make_lm(model, hf_tok, batch_size=batch_size, max_length=max_length)


def bench_cloze(model: Any, hf_tok: Any, clock: ForwardClock, docs: int, batch_size: int | str,
                doc_tokens: int = 2048) -> dict[str, Any]:
    """Six tasks x ``docs`` synthetic documents of ``doc_tokens`` (the suite's 2,048-token cap), greedy through
    HFLM, 48 tokens."""
    from lm_eval.api.instance import Instance

    rng = random.Random(0)
    lm = _hflm(model, hf_tok, batch_size, doc_tokens + 48)
    row: dict[str, float] = {}
    t0 = time.perf_counter()
    for _ in CLOZE_TASKS:
        reqs = [Instance("generate_until", {}, (hf_tok.decode(_filler(hf_tok, doc_tokens - 8, rng)) + " Key:",
                                                {"until": ["\n"], "max_gen_toks": 48, "do_sample": False}), 0)
                for _ in range(docs)]
        with clock.part(row):
            lm.generate_until(reqs, disable_tqdm=True)
    row["wall_s"] = time.perf_counter() - t0
    row["batch_size"] = batch_used(lm)
    return {"documents": docs * len(CLOZE_TASKS), "document_tokens": doc_tokens, **row,
            "documents_per_s": docs * len(CLOZE_TASKS) / row["wall_s"]}


def bench_lm(model: Any, hf_tok: Any, clock: ForwardClock, scale: float, batch_size: int | str,
             max_length: int, wikitext_tokens: int = WIKITEXT_TOKENS) -> dict[str, Any]:
    """Table 1's log-likelihood requests (``LM_SHAPES`` x ``scale`` documents) and WikiText's rolling windows."""
    from lm_eval.api.instance import Instance

    rng = random.Random(0)
    lm = _hflm(model, hf_tok, batch_size, max_length)
    tasks: dict[str, dict[str, float]] = {}
    t0 = time.perf_counter()
    for task, (n_docs, choices, ctx_len, cont_len) in LM_SHAPES.items():
        n = max(1, round(n_docs * scale))
        reqs = [Instance("loglikelihood", {}, (hf_tok.decode(_filler(hf_tok, ctx_len, rng)),
                                               " " + hf_tok.decode(_filler(hf_tok, cont_len, rng))), 0)
                for _ in range(n * choices)]
        row: dict[str, float] = {"requests": len(reqs)}
        t1 = time.perf_counter()
        with clock.part(row):
            lm.loglikelihood(reqs, disable_tqdm=True)
        row["wall_s"] = time.perf_counter() - t1
        tasks[task] = row
    n = max(1, round(WIKITEXT_DOCS * scale))
    reqs = [Instance("loglikelihood_rolling", {}, (hf_tok.decode(_filler(hf_tok, wikitext_tokens, rng)),), 0)
            for _ in range(n)]
    row = {"requests": n}
    t1 = time.perf_counter()
    with clock.part(row):
        lm.loglikelihood_rolling(reqs, disable_tqdm=True)
    row["wall_s"] = time.perf_counter() - t1
    tasks["wikitext"] = row
    return {"tasks": tasks, "scale": scale, "max_length": max_length, "batch_size": batch_used(lm),
            "wall_s": time.perf_counter() - t0}


def _batch_arg(text: str) -> int | str:
    """``--batch-size``'s value: ``auto`` or a positive int."""
    if text == AUTO:
        return AUTO
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'auto' nor a positive int")
    return int(text)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="750m")
    ap.add_argument("--mixer", default="kdn_diag")
    ap.add_argument("--pattern", default="recurrent")
    ap.add_argument("--samples-per-cell", type=int, default=500)
    ap.add_argument("--cells", default="all", help="'all' (the 14 cells) or comma-separated task@length")
    ap.add_argument("--batch-size", type=_batch_arg, default=AUTO,
                    help="RULER prompts per batch, or auto (evaluate.py's default: searched per context length)")
    ap.add_argument("--lm-batch-size", type=_batch_arg, default=AUTO, help="HFLM's batch size, or auto (lm-eval's)")
    ap.add_argument("--haystack", default=None, help="RULER's haystack (as ruler.haystack; default the KJV)")
    ap.add_argument("--cloze-docs", type=int, default=1000, help="synthetic documents per cloze task")
    ap.add_argument("--lm-scale", type=float, default=1.0, help="fraction of Table 1's documents")
    ap.add_argument("--max-length", type=int, default=4096)
    ap.add_argument("--parts", default="ruler,cloze,lm")
    ap.add_argument("--ruler-new-tokens", type=int, default=128, help="RULER decodes 128; fewer for a smoke run")
    ap.add_argument("--cloze-tokens", type=int, default=2048, help="synthetic cloze document length")
    ap.add_argument("--wikitext-tokens", type=int, default=WIKITEXT_TOKENS, help="tokens per WikiText document")
    ap.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                    help="time the first forwards (compilation) apart, before the parts")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    batch_size, lm_batch_size = (resolve_batch_size(b, device) for b in (args.batch_size, args.lm_batch_size))
    torch.manual_seed(0)
    model = models.build_model(models.model_config(args.size, args.mixer, args.pattern, vocab_size=32000))
    model = model.to(device=device, dtype=dtype).eval()
    tok = load_tokenizer("mistral-v1")
    from transformers import PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as tmp:
        hf_tok = PreTrainedTokenizerFast.from_pretrained(str(tok.save_pretrained(tmp)))
    hf_tok.pad_token, hf_tok.padding_side = hf_tok.eos_token, "left"
    clock = ForwardClock(model, device)
    from eval import ruler

    cells = [ruler.cell_name(t, n) for t in ruler.TASKS for n in ruler.GRID[t]] if args.cells == "all" else \
        [c.strip() for c in args.cells.split(",") if c.strip()]
    report: dict[str, Any] = {
        "header": {"device": device_name(device), "dtype": str(dtype).removeprefix("torch."),
                   "model": {"size": args.size, "mixer": args.mixer, "pattern": args.pattern,
                             "parameters": sum(p.numel() for p in model.parameters())},
                   "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "versions": versions(),
                   "commit": versions()["kdn"], "batch_size": batch_size, "lm_batch_size": lm_batch_size,
                   "ruler_new_tokens": args.ruler_new_tokens, "samples_per_cell": args.samples_per_cell}}
    if args.warmup:
        with torch.no_grad():
            report["header"]["warmup_s"] = warm_up(model, tok, tok.eos_id)
        print(f"warm-up (first forwards and compilation): {report['header']['warmup_s']:.1f} s", flush=True)
    parts = args.parts.split(",")
    runs = {
        "ruler": lambda: bench_ruler(model, tok, clock, cells, args.samples_per_cell, batch_size, tok.eos_id,
                                     args.ruler_new_tokens, args.haystack,
                                     on_cell=lambda part: write_json_atomic(args.out, {**report, "ruler": part})),
        "cloze": lambda: bench_cloze(model, hf_tok, clock, args.cloze_docs, lm_batch_size, args.cloze_tokens),
        "lm": lambda: bench_lm(model, hf_tok, clock, args.lm_scale, lm_batch_size, args.max_length,
                               args.wikitext_tokens),
    }
    if set(parts) - set(runs):
        raise SystemExit(f"unknown --parts {sorted(set(parts) - set(runs))}; choose from {','.join(runs)}")
    with torch.no_grad():
        for name in [p for p in runs if p in parts]:
            report[name] = runs[name]()
            write_json_atomic(args.out, report)  # after each part: a run stopped later keeps it
    print(f"{report['header']['device']}, {args.size} {args.mixer} ({report['header']['dtype']})")
    print(f"{'part':<8} {'wall s':>9} {'prefill s':>10} {'decode s':>9}  items")
    for name, unit in (("ruler", "samples"), ("cloze", "documents"), ("lm", None)):
        if name in report:
            r = report[name]
            items = r[unit] if unit else sum(t["requests"] for t in r["tasks"].values())
            pre = r.get("prefill_s", sum(t.get("prefill_s", 0.0) for t in r.get("tasks", {}).values()))
            dec = r.get("decode_s", sum(t.get("decode_s", 0.0) for t in r.get("tasks", {}).values()))
            print(f"{name:<8} {r['wall_s']:9.1f} {pre:10.1f} {dec:9.1f}  {items}")
    return report


if __name__ == "__main__":
    main()
