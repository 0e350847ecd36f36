"""Evaluation settings that change a number reach the place where they take effect, checked by value: RULER's seed
and answer budget shape the prompts and guard the results file, and RULER stops at EOS when the pad token differs
from it; the cloze suite's lm-eval window is its own, not lm-eval's ``max_length``, its document count honours the
limit, its loader cuts to the configured ``context_tokens`` and its prompt budget counts no BOS; MQAR picks its
learning rate on validation accuracy, never on the test accuracy it reports."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from eval_fixtures import export_toy_run, oracle_from
from test_eval_retrieval import _answer_of, _records
from test_eval_ruler_suite import queried_value

import evaluate
from data import load_tokenizer
from eval.mqar import parse_overrides, summarize
from eval.results import sha256_text
from eval.ruler import build_samples, load_haystack
from eval.tasks import Codec, build_docs, hf_codec, load_records, utils

TOK = load_tokenizer("mistral-v1")
RULER_TASKS = ("niah_single_1", "niah_single_2")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("numbers") / "run")


def _use_oracle(monkeypatch: pytest.MonkeyPatch, answer: Any, pad_token: str | None = None) -> None:
    """Evaluate through an oracle model; ``pad_token`` gives the exported tokenizer a pad token of its own."""
    real = evaluate.load_model

    def load(path: Path, device: str, dtype: str) -> tuple:
        tok = real(path, device=device, dtype=dtype)[1]
        if pad_token is not None:
            tok.pad_token = pad_token
        return oracle_from(path, answer), tok

    monkeypatch.setattr(evaluate, "load_model", load)


def _ruler_args(run_dir: Path, out: Path, seed: int) -> list[str]:
    return [f"model={run_dir}", "suites=[ruler]", f"out_dir={out}", "ruler.samples_per_cell=2", "ruler.haystack=kjv",
            f"ruler.tasks=[{','.join(RULER_TASKS)}]", "ruler.lengths=[1024]", "ruler.max_new_tokens=16",
            f"ruler.seed={seed}", "batch_size=2", "progress=false", "log_samples=true"]


def test_ruler_prompts_follow_seed_and_budget_and_rows_stop_at_eos(run_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The prompts are ``build_samples``' for the configured seed and ``max_new_tokens``; with a pad token (``<unk>``)
    other than EOS a row still ends at EOS, so text the model emits after it is not scored; a rerun with another
    seed refuses the results file instead of continuing it."""
    _use_oracle(monkeypatch, lambda ids: TOK.encode(" " + queried_value(ids) + ".") + [TOK.eos_id]
                + TOK.encode(" and more words after the end"), pad_token="<unk>")
    evaluate.run(evaluate.compose(_ruler_args(run_dir, tmp_path, seed=5)))
    rows = [json.loads(x) for x in (tmp_path / "ruler.samples.jsonl").read_text().splitlines()]
    hay = load_haystack("kjv")
    for task in RULER_TASKS:
        want = build_samples(task, 1024, 2, tokenizer=TOK, haystack=hay, seed=5, max_new_tokens=16)
        got = [r for r in rows if r["cell"] == f"{task}@1024"]
        assert [r["prompt_sha256"] for r in got] == [sha256_text(s["prompt"]) for s in want]
        assert [r["prompt_tokens"] for r in got] == [s["prompt_tokens"] for s in want]
        assert all(1024 - 16 - 60 < s["prompt_tokens"] <= 1024 - 16 for s in want)  # a tight fit to 1024 - 16
        assert [r["prediction"] for r in got] == [s["answers"][0] + "." for s in want]
    with pytest.raises(ValueError, match=r"other settings \(seed\)"):
        evaluate.run(evaluate.compose(_ruler_args(run_dir, tmp_path, seed=6)))
    rep = json.loads((tmp_path / "ruler.json").read_text())
    assert rep["settings"]["seed"] == 5 and rep["summary"] == {"mean": 100.0, "cells": 2}


def test_retrieval_keeps_its_window_whatever_lm_evals_max_length(run_dir: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """``max_length=64`` (lm-eval's context for Table 1) must not cut the cloze prompts, which ``context_tokens``
    already cut: lm-eval's model for this suite holds ``context_tokens`` + 48 tokens, and the oracle, which answers
    from the record number at the prompt's start, still scores 100; ``limit=2`` of 3 documents reports ``n=2``."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "swde.jsonl").write_text("".join(json.dumps(_records("swde", i)) + "\n" for i in range(3)))
    _use_oracle(monkeypatch, lambda ids: TOK.encode(" " + _answer_of(ids) + "\nmore"))
    rep = evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[retrieval]", f"out_dir={tmp_path / 'out'}",
                                         f"retrieval.data_dir={data}", "retrieval.tasks=[swde]", "max_length=64",
                                         "retrieval.context_tokens=512", "retrieval.limit=2", "batch_size=2",
                                         "progress=false"]))["reports"]["retrieval"]
    assert rep["settings"]["max_length"] == 512 + 48
    assert rep["results"]["swde"] == {"score": 100.0, "n": 2, "batch_size": 2}


@pytest.fixture(scope="module")
def hf_tok(run_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(run_dir / "hf")


def test_the_lm_eval_loader_cuts_to_the_configured_context(run_dir: Path, hf_tok: Any, tmp_path: Path) -> None:
    """``load_swde(context_tokens=300)`` (lm-eval's metadata) gives ``build_docs``' prompts for 300 tokens: at most
    300 - 48 tokens each, the answer kept, for documents of about 1,700 tokens."""
    (tmp_path / "swde.jsonl").write_text("".join(json.dumps(_records("swde", i, filler=120)) + "\n" for i in range(3)))
    loaded = list(utils.load_swde(tokenizer=str(run_dir / "hf"), data_dir=str(tmp_path), context_tokens=300)
                  ["validation"])
    want = build_docs("swde", load_records("swde", str(tmp_path)), hf_codec(hf_tok), 300)
    assert [d["prompt"] for d in loaded] == [d["prompt"] for d in want]
    for i, d in enumerate(loaded):
        assert f"Answer{i}x" in d["prompt"] and d["answers"] == [f"Answer{i}x"]
        assert 200 < len(hf_tok(d["prompt"], add_special_tokens=False)["input_ids"]) <= 300 - 48


class _BosTokenizer:
    """The exported tokenizer as one that adds BOS by default (as Llama's do): the prompt budget must not count it."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = self.tok(text, add_special_tokens=False)["input_ids"]
        return {"input_ids": [TOK.bos_id] + ids if add_special_tokens else ids}

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_the_prompt_budget_counts_no_bos(hf_tok: Any) -> None:
    """With a BOS-adding tokenizer the window counts BOS (the default call) and the budget does not: the prompts are
    those of a codec that says so explicitly, each exactly ``context_tokens - 48`` plain tokens long."""
    bos = _BosTokenizer(hf_tok)
    codec = hf_codec(bos)
    assert codec.encode("In the beginning") == [TOK.bos_id, *codec.encode_plain("In the beginning")]
    explicit = Codec(encode=lambda s: bos(s)["input_ids"], encode_plain=lambda s: bos(s, False)["input_ids"],
                     decode=lambda ids: bos.decode(ids, skip_special_tokens=True))
    question = " ".join(["Which of the numbered words came first in the list above?"] * 5)
    records = [{"context": " ".join(f"w{i}{j}" for j in range(400)), "question": question, "answers": [f"w{i}7"]}
               for i in range(2)]
    got = build_docs("drop", records, codec, 300)  # a 250-token window and the question exceed the budget
    assert got == build_docs("drop", records, explicit, 300)
    assert [len(codec.encode_plain(d["prompt"])) for d in got] == [300 - 48] * 2


def test_mqar_picks_the_learning_rate_on_validation_and_reports_test_at_it() -> None:
    """Validation prefers lr 1e-3 and test accuracy prefers 1e-2: the row reports 1e-3's test accuracies (mean and
    sample std over the seeds), never the higher ones of 1e-2."""
    cfg, _ = parse_overrides(["mixers=kda", "widths=64", "settings=64x4", "lrs=0.001,0.01", "seeds=0,1,2",
                              "preset=cpu"])
    valid = {1e-3: (0.81, 0.78, 0.84), 1e-2: (0.62, 0.70, 0.66)}
    test = {1e-3: (0.75, 0.71, 0.80), 1e-2: (0.90, 0.93, 0.88)}
    records = [{"setting": "64x4", "mixer": "kda", "width": 64, "lr": lr, "seed": seed, "valid_acc": valid[lr][seed],
                "test_acc": test[lr][seed], "diverged": False, "state": 8192, "state_recurrent": True, "params": 99}
               for lr in (1e-2, 1e-3) for seed in (2, 0, 1)]
    (row,) = summarize(records, cfg)
    assert row["best_lr"] == 1e-3 and row["seeds"] == [0, 1, 2]
    assert row["test_acc"] == list(test[1e-3])
    assert row["test_acc_mean"] == pytest.approx(0.7533333333333333, rel=1e-12)
    assert row["test_acc_std"] == pytest.approx(0.045092497528228984, rel=1e-12)
    assert row["valid_acc_by_lr"] == {"0.001": pytest.approx(0.81), "0.01": pytest.approx(0.66)}
