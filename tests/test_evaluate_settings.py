"""Every evaluation setting that changes a number reaches the component it configures, checked by value where it
takes effect (lm-eval's model, the generator, the shard loader), not in the results file; the quick preset's
promises (RULER only, small, what the demo model should score); lm-eval's non-actionable warnings filtered within
the evaluation only; the commit recorded in ``model.git_commit``."""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from eval_fixtures import export_toy_run, verse_shards

import data
import eval.ruler_suite
import evaluate
from eval.harness import make_lm, quiet_lm_eval
from eval.results import git_commit

MC_TASK = """task: kdn_settings_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
"""


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("run") / "toy", seq_len=4096)


@pytest.fixture(scope="module")
def mc_task(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tasks")
    rows = [{"question": f"Verse {i}: in the beginning", "choices": ["God created", "the heaven", "and the earth"],
             "label": i % 3} for i in range(7)]
    (tmp / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp / "yaml").mkdir()
    (tmp / "yaml" / "mc.yaml").write_text(MC_TASK.format(data=tmp / "mc.jsonl"))
    return tmp / "yaml"


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("shards")
    return verse_shards(tmp, 80)


def test_lm_evals_model_gets_the_configured_max_length_batch_size_and_limit(
        run_dir: Path, mc_task: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import lm_eval
    from lm_eval.models import huggingface

    built: list[Any] = []
    limits: list[Any] = []

    class Recorded(huggingface.HFLM):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(self)

    real_evaluate = lm_eval.simple_evaluate

    def recorded_evaluate(*args: Any, **kwargs: Any) -> Any:
        limits.append(kwargs.get("limit"))
        return real_evaluate(*args, **kwargs)

    monkeypatch.setattr(huggingface, "HFLM", Recorded)
    monkeypatch.setattr(lm_eval, "simple_evaluate", recorded_evaluate)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[lm]", f"out_dir={tmp_path}", "progress=false",
                                   "lm.tasks=[kdn_settings_mc]", f"lm.include_path={mc_task}", "max_length=96",
                                   "batch_size=3", "lm.limit=4"]))
    assert len(built) == 1
    assert built[0].max_length == 96  # HFLM's own fallback is 2048
    assert built[0].batch_size == 3
    assert limits == [4]
    evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[lm]", f"out_dir={tmp_path / 'default'}",
                                   "progress=false", "lm.tasks=[kdn_settings_mc]", f"lm.include_path={mc_task}"]))
    assert built[1].max_length == 4096  # unset: the run's training context (data.seq_len)


def test_the_generator_gets_max_new_tokens_stop_ids_and_batch_size(run_dir: Path, tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = eval.ruler_suite.greedy_generate

    def recorded(model: Any, prompts: Any, **kwargs: Any) -> list[list[int]]:
        out = real(model, prompts, **kwargs)
        calls.append({**kwargs, "n": len(prompts), "longest": max(map(len, out))})
        return out

    monkeypatch.setattr(eval.ruler_suite, "greedy_generate", recorded)
    evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[ruler]", f"out_dir={tmp_path}", "progress=false",
                                   "ruler.tasks=[niah_single_2]", "ruler.lengths=[1024]", "ruler.samples_per_cell=3",
                                   "ruler.max_new_tokens=5", "ruler.haystack=kjv", "batch_size=2"]))
    (call,) = calls
    assert call["max_new_tokens"] == 5 and call["batch_size"] == 2 and call["n"] == 3
    assert call["stop_ids"] == {2} and call["pad_id"] == 2  # the tokenizer's EOS (the pad token is unset)
    assert 0 < call["longest"] <= 5  # a random model never stops early: it decodes the whole budget


def test_perplexity_and_the_probe_read_windows_of_the_configured_length(run_dir: Path, shards: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    loaders: list[dict[str, Any]] = []
    real = data.TokenLoader

    class Recorded(real):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            loaders.append({**kwargs, "batches": 0})

        def __iter__(self) -> Any:
            for batch in super().__iter__():
                loaders[-1]["batches"] += 1
                loaders[-1]["shape"] = tuple(batch["input_ids"].shape)
                yield batch

    monkeypatch.setattr(data, "TokenLoader", Recorded)
    evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[ppl,beta_eff]", f"out_dir={tmp_path}",
                                   f"ppl.shards={shards}", "ppl.seq_len=24", "ppl.max_batches=2",
                                   f"beta_eff.shards={shards}", "beta_eff.n_seqs=3", "beta_eff.seq_len=20",
                                   "progress=false"]))
    ppl, probe = loaders
    assert ppl["seq_len"] == 24 and ppl["split"] == "val" and ppl["shape"][1] == 24
    assert ppl["batches"] == 3  # max_batches=2: the third is read and not used
    assert probe["seq_len"] == 20 and probe["batch_size"] == 3 and probe["shape"] == (3, 20)


def test_the_quick_preset_runs_little_and_says_what_to_expect(run_dir: Path, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch,
                                                              capsys: pytest.CaptureFixture) -> None:
    cfg = evaluate.compose([f"model={run_dir}", "preset=quick"])
    assert list(cfg.suites) == ["ruler"] and cfg.offline and cfg.skip_unavailable and cfg.ruler.haystack == "kjv"
    cells = eval.ruler_suite.ruler_cells(list(cfg.ruler.tasks), list(cfg.ruler.lengths))
    # the time budget: 8 cells x 4 samples of 1K-2K tokens, 32 new tokens each (measured in quick.yaml)
    assert len(cells) * cfg.ruler.samples_per_cell <= 32 and max(cfg.ruler.lengths) <= 2048
    assert cfg.ruler.max_new_tokens <= 32
    assert "0 in every RULER cell" in cfg.expected
    monkeypatch.setattr(eval.ruler_suite, "greedy_generate",
                        lambda model, prompts, **kw: [[29473] for _ in prompts])  # skip the decoding
    evaluate.run(evaluate.compose([f"model={run_dir}", "preset=quick", f"out_dir={tmp_path}", "progress=false",
                                   "ruler.tasks=[niah_single_1]", "ruler.lengths=[1024]"]))
    out = capsys.readouterr().out
    assert "expected: 0 in every RULER cell for the demo model" in out
    assert "\n" not in out.split("expected: ")[1].split("\nresults in")[0]  # one line


def test_lm_evals_non_actionable_warnings_are_dropped_inside_the_evaluation_only(
        run_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    from eval.harness import load_model

    model, tok = load_model(run_dir / "hf", device="cpu")
    task_log = logging.getLogger("lm_eval.api.task")
    caplog.set_level(logging.INFO)
    with quiet_lm_eval():
        make_lm(model, tok, batch_size=1, max_length=64)
        task_log.warning("kdn_swde: Custom kwargs can be passed to `--metadata` in console (as json string)")
        task_log.warning("Left truncation applied. Original sequence length was 90")
    inside = [r.getMessage() for r in caplog.records]
    assert not any("not of type `str`" in m or "--metadata" in m or "already-initialized" in m for m in inside)
    assert any("Left truncation applied" in m for m in inside)  # a warning a user can act on passes
    caplog.clear()
    make_lm(model, tok, batch_size=1, max_length=64)
    assert any("not of type `str`" in r.getMessage() for r in caplog.records)  # the filter is gone after it


def test_results_record_the_commit_of_the_code(run_dir: Path, tmp_path: Path, shards: Path) -> None:
    commit = git_commit()
    assert commit, "the tests run in a git checkout"
    rep = evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[ppl]", f"out_dir={tmp_path}",
                                         f"ppl.shards={shards}", "ppl.seq_len=16", "progress=false"]))
    model = rep["reports"]["ppl"]["model"]
    assert model["git_commit"] == commit == rep["reports"]["ppl"]["versions"]["kdn"]
    assert model["git_commit_source"] == "evaluation checkout"
    recorded = tmp_path / "recorded"
    export_toy_run(recorded)
    with open(recorded / "config.yaml", "a") as f:
        f.write("git_commit: 0123456789abcdef\n")
    rep = evaluate.run(evaluate.compose([f"model={recorded}", "suites=[ppl]", f"out_dir={tmp_path / 'r'}",
                                         f"ppl.shards={shards}", "ppl.seq_len=16", "progress=false"]))
    assert rep["reports"]["ppl"]["model"]["git_commit"] == "0123456789abcdef"
    assert rep["reports"]["ppl"]["model"]["git_commit_source"] == "run"


@pytest.mark.parametrize("key, old, new", [("truncation", "answer_window", "jrt"), ("context_tokens", 2000, 2048),
                                           ("haystack", {"name": "kjv"}, {"name": "essays"}),
                                           ("max_new_tokens", 128, 32), ("samples_per_cell", 20, 500)])
def test_a_results_file_continues_only_under_its_own_number_settings(key: str, old: object, new: object) -> None:
    from eval.results import differing_settings

    assert differing_settings({key: old, "seed": 0}, {key: new, "seed": 0}) == [key]
    assert differing_settings({key: old, "seed": 0}, {key: old, "seed": 0}) == []
