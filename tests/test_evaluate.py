"""evaluate.py: the lm suite through lm-eval on local task files (numbers equal the model's own log-likelihoods),
shard perplexity, the beta_eff probe, checkpoint export, and one-line refusals of bad input."""
from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from eval_fixtures import export_toy_run, verse_shards

import evaluate
import models
from data import TokenLoader
from eval.harness import ACC_METRIC, Unavailable, load_model, load_task, table1_row, task_manager
from eval.model_dir import resolve
from eval.overwrite import probe_beta_eff
from trainer.checkpoint import EXPORT_MANIFEST, write_manifest

MC_TASK = """task: kdn_local_mc
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
PPL_TASK = """task: kdn_local_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
"""
TEXTS = ["And God said, Let there be light: and there was light.", "In the beginning God created the heaven."]
ROWS = [{"question": f"Question {i}: the sky is", "choices": ["blue.", "made of cheese and wires.", "green"],
         "label": i % 3} for i in range(5)]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return export_toy_run(tmp_path_factory.mktemp("run") / "toy", seq_len=64)


@pytest.fixture(scope="module")
def local_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("tasks")
    (tmp / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    (tmp / "text.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in TEXTS))
    (tmp / "yaml").mkdir()
    (tmp / "yaml" / "mc.yaml").write_text(MC_TASK.format(data=tmp / "mc.jsonl"))
    (tmp / "yaml" / "ppl.yaml").write_text(PPL_TASK.format(data=tmp / "text.jsonl"))
    return tmp / "yaml"


def _lm(run_dir: Path, tasks: Path, out: Path, *extra: str) -> dict:
    return evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[lm]", f"out_dir={out}", "progress=false",
                                          "lm.tasks=[kdn_local_mc,kdn_local_ppl]", f"lm.include_path={tasks}",
                                          *extra]))["reports"]["lm"]


def test_lm_suite_numbers_are_the_models_own_log_likelihoods(run_dir: Path, local_tasks: Path, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rep = _lm(run_dir, local_tasks, tmp_path, "batch_size=4")
    assert rep == json.loads((tmp_path / "lm.json").read_text())
    assert rep["settings"]["max_length"] == 64  # the run's training context
    model, tok = load_model(run_dir / "hf", device="cpu")

    def ids(s: str) -> list[int]:
        return tok(s, add_special_tokens=False)["input_ids"]

    def loglik(context: list[int], cont: list[int]) -> float:
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([(context + cont)[:-1]])).logits[0].double(), -1)
        return float(sum(logp[len(context) - 1 + i, t] for i, t in enumerate(cont)))

    hits = []
    for row in ROWS:
        lls = [loglik(ids(row["question"]), ids(row["question"] + " " + c)[len(ids(row["question"])):])
               for c in row["choices"]]
        hits.append(max(range(3), key=lambda j: lls[j]) == row["label"])
    assert rep["results"]["kdn_local_mc"]["acc"] == pytest.approx(sum(hits) / len(hits), abs=1e-12)
    total = sum(loglik([tok.eos_token_id], ids(t)) for t in TEXTS)  # one window each, EOS as the prefix
    words = sum(len(re.split(r"\s+", t)) for t in TEXTS)
    assert rep["results"]["kdn_local_ppl"]["word_perplexity"] == pytest.approx(math.exp(-total / words), rel=1e-5)
    assert rep["results"]["kdn_local_ppl"]["n"] == 2
    single = _lm(run_dir, local_tasks, tmp_path / "bs1", "batch_size=1")
    assert single["results"]["kdn_local_mc"]["acc"] == rep["results"]["kdn_local_mc"]["acc"]
    assert single["results"]["kdn_local_ppl"]["word_perplexity"] == pytest.approx(
        rep["results"]["kdn_local_ppl"]["word_perplexity"], rel=1e-6)


def test_table1_row_uses_the_papers_metrics() -> None:
    results = {t: {"acc": 0.5, "acc_norm": 0.6} for t in ACC_METRIC}
    results["wikitext"] = {"word_perplexity": 18.6}
    results["lambada_openai"].update(perplexity=14.2)
    row = table1_row(results)
    assert row["wiki_ppl"] == 18.6 and row["lmb_ppl"] == 14.2
    assert row["hellaswag"] == 60.0 and row["piqa"] == 50.0
    assert row["avg"] == pytest.approx((4 * 50.0 + 2 * 60.0) / 6)
    assert "avg" not in table1_row({"piqa": {"acc": 0.7}})


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("shards")
    return verse_shards(tmp, 80)


def test_ppl_suite_is_the_token_weighted_model_loss(run_dir: Path, shards: Path, tmp_path: Path) -> None:
    out = evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[ppl]", f"out_dir={tmp_path}",
                                         f"ppl.shards={shards}", "ppl.seq_len=32", "progress=false"]))
    val = out["reports"]["ppl"]["results"]["val"]
    model, _ = load_model(run_dir / "hf", device="cpu")
    losses, counts = [], []
    with torch.no_grad():
        for batch in TokenLoader(shards, split="val", seq_len=32, batch_size=4):
            losses.append(float(model(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss))
            counts.append(batch["input_ids"].numel() - batch["input_ids"].shape[0])
    expected = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)
    assert val["loss"] == pytest.approx(expected, rel=1e-6) and val["ppl"] == pytest.approx(math.exp(expected))
    assert out["reports"]["ppl"]["summary"] == {"val_ppl": val["ppl"]}


def test_beta_eff_suite_summarises_every_kdn_layer(run_dir: Path, shards: Path, tmp_path: Path) -> None:
    out = evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[beta_eff]", f"out_dir={tmp_path}",
                                         f"beta_eff.shards={shards}", "beta_eff.n_seqs=2", "beta_eff.seq_len=16",
                                         "progress=false"]))
    model, _ = load_model(run_dir / "hf", device="cpu")
    betas = probe_beta_eff(model, shards, n_seqs=2, seq_len=16)
    pooled = torch.cat([b.flatten() for b in betas.values()]).double()
    probe = out["reports"]["beta_eff"]["results"]["probe"]
    assert sorted(probe["layers"]) == ["0", "1"]
    assert probe["pooled"]["mean"] == pytest.approx(float(pooled.mean()), rel=1e-6)
    assert out["reports"]["beta_eff"]["summary"]["mean"] == probe["pooled"]["mean"]
    assert (tmp_path / "beta_eff.png").stat().st_size > 0


def test_a_checkpoint_is_exported_then_evaluated(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run")
    model, _ = load_model(run / "hf", device="cpu")
    ckpt = run / "checkpoints" / "step_000000010"
    ckpt.mkdir(parents=True)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(1.5)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    (ckpt / "train_state.json").write_text(json.dumps({"step": 10}))
    write_manifest(ckpt)
    target = resolve(ckpt)
    assert target.step == 10 and target.out_dir == run / "eval" / "step_000000010" and target.run_dir == run
    again, _ = load_model(target.hf_dir, device="cpu")
    x = torch.randint(3, 32000, (1, 12))
    with torch.no_grad():
        ref, got = model(input_ids=x).logits, again(input_ids=x).logits
    assert float((got - ref).norm() / ref.norm()) < 1e-6
    # a run export is matched to the run's checkpoints through its export.json, as train.py writes it
    write_manifest(run / "hf", EXPORT_MANIFEST, {"step": 10, "tokens": 40960, "checkpoint": ckpt.name})
    assert resolve(run).hf_dir == run / "hf" and resolve(run / "hf").out_dir == run / "eval"


def test_bad_input_is_refused_in_one_line(run_dir: Path, local_tasks: Path, tmp_path: Path,
                                          capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(FileNotFoundError, match="no such directory; pass a run directory"):
        evaluate.run(evaluate.compose([f"model={tmp_path / 'missing'}"]))
    (tmp_path / "unfinished").mkdir()
    (tmp_path / "unfinished" / "config.yaml").write_text("name: x\n")
    with pytest.raises(FileNotFoundError, match="no hf/ export yet"):
        evaluate.run(evaluate.compose([f"model={tmp_path / 'unfinished'}"]))
    with pytest.raises(ValueError, match=r"unknown suite\(s\) \['tables'\]"):
        evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[lm,tables]"]))
    with pytest.raises(ValueError, match="unknown lm-eval task 'no_such_task'"):
        load_task(task_manager(local_tasks, defaults=False), "no_such_task")
    with pytest.raises(ValueError, match="suite ppl needs ppl.shards="):
        evaluate.run(evaluate.compose([f"model={run_dir}", "suites=[ppl]", f"out_dir={tmp_path}"]))
    full = export_toy_run(tmp_path / "full", pattern="A", seq_len=64)
    with pytest.raises(ValueError, match="lm-eval at max_length=128 needs 128 tokens but this full-attention"):
        evaluate.run(evaluate.compose([f"model={full}", "suites=[lm]", "max_length=128", f"out_dir={tmp_path}"]))
    with pytest.raises(ValueError, match="retrieval at context_tokens=2048 needs 2096 tokens"):
        evaluate.run(evaluate.compose([f"model={full}", "suites=[retrieval]", f"out_dir={tmp_path}"]))
    assert issubclass(Unavailable, RuntimeError) and models.KDNForCausalLM
