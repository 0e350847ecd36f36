"""Evaluate a trained model: lm-eval (Table 1), modified RULER (Table 2), cloze retrieval (Table 3), held-out
perplexity and the overwrite probe, from one Hydra command (conf/eval/config.yaml).

    python evaluate.py model=runs/small_recurrent_kdn_diag preset=quick        # offline CPU demo, prints a table
    python evaluate.py model=runs/<name> suites=[lm,ruler,retrieval]          # the paper's protocol
    python evaluate.py model=runs/<name>/checkpoints/step_000001000 suites=[ruler]
    python evaluate.py model=runs/<name> suites=[ppl] ppl.shards=data/cache/embedded-kjv-mistral-v1
    python evaluate.py model=runs/<name> suites=[beta_eff] beta_eff.shards=data/cache/<shards>
    python evaluate.py -m model=runs/a,runs/b hydra/launcher=slurm                   # a sweep on SLURM

Each suite writes ``<run dir>/eval/<suite>.json`` (schema in eval/results.py) after every finished cell, with the
SHA-256 of the weights it was computed on; a rerun skips the suites and cells finished on the same weights unless
``overwrite=true`` (which recomputes its own cells only), and recomputes those of other weights (a continued run's
new export). A checkpoint is verified against its manifest first, as a resume verifies it. Evaluations of one model
may run at once (a sweep, SLURM jobs): their cells merge into the same files, and a cell one of them is computing is
not computed twice. Bad input (an override key that the config lacks included) exits with one line naming the fix.
"""
from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path
from typing import Any

import data  # noqa: F401  (our packages load before the checkout leaves sys.path, see _unshadow)
import eval.ruler_suite  # noqa: F401
import models  # noqa: F401
from eval.config import EvalConfig, check_override_keys, load_eval_config
from eval.generation import resolve_batch_size
from eval.harness import Unavailable, go_offline, load_model, quiet_lm_eval
from eval.model_dir import (
    full_attention_limit,
    model_files_unchanged,
    model_metadata,
    resolve,
    training_context,
)
from eval.suites import Context, run_beta_eff, run_lm, run_ppl, run_retrieval

ROOT = Path(__file__).resolve().parent
CONF = ROOT / "conf" / "eval"
RUNNERS = {"lm": run_lm, "ruler": eval.ruler_suite.run_ruler, "retrieval": run_retrieval, "ppl": run_ppl,
           "beta_eff": run_beta_eff}
log = logging.getLogger("evaluate")


def _unshadow() -> None:
    """This script shares its name with Hugging Face's ``evaluate`` library, which some lm-eval tasks import.
    Run as a script, take the checkout off ``sys.path`` (our packages are loaded by now) so they find the library."""
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != ROOT]


def build_context(cfg: EvalConfig) -> Context:
    """Resolve and load the model named by ``cfg.model`` and hash the files it was loaded from; everything the
    suites share."""
    import torch

    from data import load_tokenizer

    target = resolve(cfg.model)
    if "ruler" in cfg.suites:  # essays that cannot be reached stop the run before the model is loaded
        eval.ruler_suite.load_ruler_haystack(cfg.ruler)
    if cfg.out_dir:
        target = dataclasses.replace(target, out_dir=Path(cfg.out_dir))
    device = "cuda" if cfg.device == "auto" and torch.cuda.is_available() else \
        ("cpu" if cfg.device == "auto" else cfg.device)
    dtype = ("bfloat16" if device.startswith("cuda") else "float32") if cfg.dtype == "auto" else cfg.dtype
    batch_size = resolve_batch_size(cfg.batch_size, device)  # a bad value stops the run before the model loads
    with model_files_unchanged(target.hf_dir) as weights:
        model, hf_tok = load_model(target.hf_dir, device=device, dtype=dtype)
    if hf_tok.pad_token_id is None:  # left padding of batched prompts: pad with EOS, masked out
        hf_tok.pad_token = hf_tok.eos_token
    hf_tok.padding_side = "left"
    return Context(target=target, model=model, hf_tokenizer=hf_tok, tokenizer=load_tokenizer(str(target.hf_dir)),
                   device=torch.device(device), dtype=dtype,
                   max_length=int(cfg.max_length or training_context(target)),
                   attention_limit=full_attention_limit(model.config, target), model_meta=model_metadata(target, model),
                   weights=weights, batch_size=batch_size, overwrite=cfg.overwrite,
                   log_samples=cfg.log_samples, skip_unavailable=cfg.skip_unavailable, progress=cfg.progress)


def format_table(reports: dict[str, dict[str, Any]], skipped: dict[str, str]) -> str:
    """The results of every suite run, one line per cell and one summary line per suite; then what was skipped."""
    lines = []
    for suite, rep in reports.items():
        lines.append(f"== {suite} ({rep['model']['name']}, {rep['wall_time_s']:.0f} s)")
        for cell, res in rep["results"].items():
            nums = res if isinstance(res, dict) else {"value": res}
            shown = "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in nums.items()
                              if isinstance(v, (int, float)))
            lines.append(f"  {cell:<28} {shown}")
        if rep["summary"]:
            lines.append("  " + "  ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                          for k, v in rep["summary"].items()))
    by_suite: dict[str, list[str]] = {}
    for what in skipped:
        by_suite.setdefault(what.split("/")[0], []).append(what)
    for suite, items in by_suite.items():  # one line per suite: what did not run, and the first reason
        cells = [w.split("/", 1)[1] for w in items if "/" in w]
        lines.append(f"skipped {suite}{f' ({len(cells)}: ' + ', '.join(cells) + ')' if cells else ''}: "
                     f"{skipped[items[0]]}")
    return "\n".join(lines)


def run(cfg: EvalConfig) -> dict[str, Any]:
    """Run ``cfg.suites`` on ``cfg.model``; returns ``{"reports": {suite: results file}, "skipped": {...}}``.
    Prints one table of every suite's cells, what was skipped, and ``cfg.expected`` (what a preset's model should
    score) when set."""
    suites = list(cfg.suites)
    unknown = [s for s in suites if s not in RUNNERS]
    if unknown or not suites:
        raise ValueError(f"unknown suite(s) {unknown or suites}: choose from suites=[{','.join(RUNNERS)}]")
    if cfg.offline:  # no network calls: hub datasets come from the local cache or are reported missing
        go_offline()
    ctx = build_context(cfg)
    reports: dict[str, dict[str, Any]] = {}
    with quiet_lm_eval():
        for suite in suites:
            try:
                rep = RUNNERS[suite](ctx, getattr(cfg, suite))
            except Unavailable as e:
                if not ctx.skip_unavailable:
                    raise
                ctx.skipped[suite] = str(e)
                continue
            if rep["results"]:
                reports[suite] = rep
            elif not any(k.startswith(f"{suite}/") for k in ctx.skipped):
                ctx.skipped[suite] = "no cell ran"
    print(format_table(reports, ctx.skipped))
    if cfg.expected:
        print(f"expected: {' '.join(str(cfg.expected).split())}")
    print(f"results in {ctx.target.out_dir}")
    return {"reports": reports, "skipped": dict(ctx.skipped)}


def compose(overrides: list[str]) -> EvalConfig:
    """The typed config ``python evaluate.py <overrides>`` would run (Hydra's compose API; for tests and scripts),
    its override keys and values checked as the command line's are."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    check_override_keys(list(overrides))
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return load_eval_config(hydra_compose(config_name="config", overrides=list(overrides)))


def main() -> None:
    import hydra

    try:
        check_override_keys(sys.argv[1:])
    except ValueError as e:
        print(f"evaluate: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    @hydra.main(config_path=str(CONF), config_name="config", version_base="1.3")
    def app(cfg: Any) -> None:
        try:
            run(load_eval_config(cfg))
        except (ValueError, FileNotFoundError, Unavailable) as e:
            print(f"evaluate: {str(e).splitlines()[0]}", file=sys.stderr)
            raise SystemExit(2) from None

    app()


if __name__ == "__main__":
    _unshadow()
    main()
