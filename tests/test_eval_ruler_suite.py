"""The RULER runner (Table 2) end to end: a model that emits the queried value scores 100, one that emits nothing
scores 0; cells are written as they finish and a rerun continues after a crash; the results name their haystack;
the paper preset stops before loading a model when the essays cannot be reached; every cell records its batches,
and with ``batch_size=auto`` on CUDA the cells of one context length share one batch search."""
from __future__ import annotations

import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

import datasets
import pytest
from eval_fixtures import export_toy_run, oracle_from

import eval.ruler_suite
import evaluate
from data import load_tokenizer
from eval.generation import BatchSearch
from eval.ruler import load_haystack

TOK = load_tokenizer("mistral-v1")
CELLS = ["niah_single_1@1024", "niah_multikey_1@1024"]
FIXES = ("ruler.haystack=/path/PaulGrahamEssays.json", "ruler.haystack=kjv")


class Bar:
    """Stands in for tqdm: keeps the total it was created with and what was counted."""

    def __init__(self, bars: list[Bar], total: int, **_: Any) -> None:
        self.total = self.created_with = total
        self.n = 0
        bars.append(self)

    def update(self, n: int) -> None:
        self.n += n

    def set_postfix_str(self, _: str) -> None:
        pass

    def close(self) -> None:
        pass


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("r") / "run")


def queried_value(ids: list[int]) -> str:
    text = TOK.decode(ids)
    key = re.findall(r"special magic \w+ for (.+?) mentioned in the provided text", text)[-1]
    return re.search(re.escape(f"for {key} is: ") + r"(\S+?)\.", text).group(1)


def _use_oracle(monkeypatch: pytest.MonkeyPatch, answer: object) -> None:
    real = evaluate.load_model
    monkeypatch.setattr(evaluate, "load_model", lambda p, device, dtype: (
        oracle_from(p, answer), real(p, device=device, dtype=dtype)[1]))


def _args(run_dir: Path, out: Path, *extra: str, haystack: str = "kjv") -> list[str]:
    return [f"model={run_dir}", "suites=[ruler]", f"out_dir={out}", "ruler.samples_per_cell=3",
            f"ruler.haystack={haystack}", "ruler.tasks=[niah_single_1,niah_multikey_1]", "ruler.lengths=[1024]",
            "batch_size=2", "progress=false", "ruler.max_new_tokens=16", *extra]


@pytest.mark.parametrize("right", [True, False])
def test_right_answers_score_100_and_silence_scores_0(right: bool, run_dir: Path, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """On RULER's essays file (the paper's haystack) and on the KJV, named as such in the results."""
    _use_oracle(monkeypatch, (lambda ids: TOK.encode(" " + queried_value(ids) + ".")) if right else (lambda ids: []))
    essays = tmp_path / "PaulGrahamEssays.json"
    essays.write_text(json.dumps({"text": "\n\n".join(
        " ".join(f"Essay {e} sentence {i} says a few plain words." for i in range(150)) for e in range(5))}))
    opening = json.loads(essays.read_text())["text"][:100]  # stands in for the essays RULER's file opens with
    monkeypatch.setattr("eval.ruler.essays.GKAMRADT_ESSAYS",
                        (("e0.txt", len(opening), hashlib.sha256(opening.encode()).hexdigest()),))
    haystack = str(essays) if right else "kjv"
    out = evaluate.run(evaluate.compose(_args(run_dir, tmp_path, "log_samples=true", haystack=haystack)))
    rep = json.loads((tmp_path / "ruler.json").read_text())
    assert rep == out["reports"]["ruler"] and list(rep["results"]) == CELLS
    assert {r["score"] for r in rep["results"].values()} == {100.0 if right else 0.0}
    assert rep["summary"] == {"mean": 100.0 if right else 0.0, "cells": 2}
    s = rep["settings"]
    assert s["samples_per_cell"] == 3 and s["max_new_tokens"] == 16 and s["batch_size"] == 2
    assert all(r["batch_sizes"] == [2, 1] for r in rep["results"].values())  # 3 samples, batch_size=2
    assert s["haystack"] == load_haystack(haystack).describe()
    assert (s["haystack"]["name"], s["haystack"]["paper"]) == (("essays", True) if right else ("kjv", False))
    assert s["lengths"] == [1024] and "max_length" not in s  # the cells' budgets, not lm-eval's context
    assert s["tokenizer_sha256"] == load_tokenizer(str(run_dir / "hf")).fingerprint
    m = rep["model"]
    assert m["mixer"] == "kdn_diag" and m["tokens_trained"] == 40960 and m["seed"] == 3 and m["parameters"] > 0
    assert rep["versions"]["torch"] and rep["schema"] == 1
    rows = [json.loads(x) for x in (tmp_path / "ruler.samples.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and {r["cell"] for r in rows} == set(CELLS)
    assert all(len(r["prompt_sha256"]) == 64 and r["answers"] for r in rows)


def test_a_crash_keeps_finished_cells_and_a_rerun_continues(run_dir: Path, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    _use_oracle(monkeypatch, lambda ids: TOK.encode(" " + queried_value(ids)))
    calls: list[int] = []
    real = eval.ruler_suite.greedy_generate

    def flaky(*a: object, **k: object) -> list[list[int]]:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("device lost")
        return real(*a, **k)

    monkeypatch.setattr(eval.ruler_suite, "greedy_generate", flaky)
    bars: list[Bar] = []
    monkeypatch.setattr(eval.ruler_suite, "tqdm", lambda **kw: Bar(bars, **kw))
    with pytest.raises(RuntimeError, match="device lost"):
        evaluate.run(evaluate.compose(_args(run_dir, tmp_path)))
    assert list(json.loads((tmp_path / "ruler.json").read_text())["results"]) == CELLS[:1]
    evaluate.run(evaluate.compose(_args(run_dir, tmp_path)))
    assert len(calls) == 3  # cell 1 was not run again
    # the bar's total is the samples still to run, from the start: both cells, then the one left
    assert [(b.created_with, b.total, b.n) for b in bars] == [(6, 6, 3), (3, 3, 3)]
    assert list(json.loads((tmp_path / "ruler.json").read_text())["results"]) == CELLS
    evaluate.run(evaluate.compose(_args(run_dir, tmp_path)))
    assert len(calls) == 3  # a finished suite is skipped
    evaluate.run(evaluate.compose(_args(run_dir, tmp_path, "overwrite=true")))
    assert len(calls) == 5
    with pytest.raises(ValueError, match=r"other settings \(samples_per_cell\).*overwrite=true"):
        evaluate.run(evaluate.compose(_args(run_dir, tmp_path, "ruler.samples_per_cell=4")))


def test_bad_cells_and_contexts_are_refused(run_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"unknown RULER task\(s\) \['niah_double'\]"):
        evaluate.run(evaluate.compose(_args(run_dir, tmp_path, "ruler.tasks=[niah_double]")))
    with pytest.raises(ValueError, match=r"RULER length\(s\) \[8192\] are in no selected task's grid"):
        evaluate.run(evaluate.compose(_args(run_dir, tmp_path, "ruler.tasks=[niah_single_3]",
                                            "ruler.lengths=[1024,8192]")))
    attn = export_toy_run(tmp_path / "attn", pattern="A", seq_len=1024)  # full attention in every layer
    with pytest.raises(ValueError, match=r"RULER cell niah_single_1@2048 needs 2048 tokens but this full-attention "
                                         r"model was trained on 1024"):
        evaluate.run(evaluate.compose(_args(attn, tmp_path, "ruler.lengths=[1024,2048]")))


def test_paper_preset_without_the_essays_stops_before_a_model_loads(run_dir: Path, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    def offline(name: str, split: str) -> None:
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub (OfflineModeIsEnabled)")

    def no_model(*a: object, **k: object) -> None:
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    monkeypatch.setattr(evaluate, "load_model", no_model)
    assert evaluate.compose(["model=x"]).ruler.haystack == "essays"  # the default preset is the paper's
    assert evaluate.compose(["model=x", "preset=quick"]).ruler.haystack == "kjv"
    argv = [f"model={run_dir}", "suites=[lm,ruler]", f"out_dir={tmp_path}", "preset=paper"]
    with pytest.raises(ValueError, match="ruler.haystack=essays") as err:
        evaluate.run(evaluate.compose(argv))
    assert all(fix in str(err.value) for fix in FIXES) and "\n" not in str(err.value)
    monkeypatch.setattr(sys, "argv", ["evaluate.py", *argv])
    with pytest.raises(SystemExit) as done:
        evaluate.main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and len(lines) == 1 and all(fix in lines[0] for fix in FIXES), lines
    assert not (tmp_path / "ruler.json").exists()


def test_auto_batches_are_8_on_the_cpu_and_one_search_per_context_length_on_cuda(
        run_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _use_oracle(monkeypatch, lambda ids: TOK.encode(" " + queried_value(ids)))
    args = [a for a in _args(run_dir, tmp_path / "cpu") if not a.startswith("batch_size=")]
    rep = evaluate.run(evaluate.compose(args))["reports"]["ruler"]
    assert rep["settings"]["batch_size"] == 8 and [r["batch_sizes"] for r in rep["results"].values()] == [[3], [3]]
    made: list[BatchSearch] = []

    class FromOne(BatchSearch):  # from 1 row, so that 3 samples a cell show the search's progress
        def __init__(self, cap: int) -> None:
            super().__init__(start=1, cap=cap)
            made.append(self)

    monkeypatch.setattr(eval.ruler_suite, "BatchSearch", FromOne)
    monkeypatch.setattr(evaluate, "resolve_batch_size", lambda value, device: "auto")  # as on CUDA
    args = [a.replace(str(tmp_path / "cpu"), str(tmp_path / "cuda")).replace("[1024]", "[1024,2048]")
            for a in args]
    rep = evaluate.run(evaluate.compose(args))["reports"]["ruler"]
    assert rep["settings"]["batch_size"] == "auto" and len(made) == 2 and all(s.cap == 3 for s in made)
    # 1 row twice (measured), then 2: the second cell of a length continues its first cell's search
    assert {c: r["batch_sizes"] for c, r in rep["results"].items()} == {
        "niah_single_1@1024": [1, 1, 1], "niah_single_1@2048": [1, 1, 1],
        "niah_multikey_1@1024": [2, 1], "niah_multikey_1@2048": [2, 1]}
