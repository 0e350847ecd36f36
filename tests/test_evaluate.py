"""evaluate.py: an exported model through lm-eval (local task files, offline) and shard perplexity."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

import evaluate
import models
from data import PrepareConfig, TokenLoader, load_tokenizer, prepare
from eval.harness import ACC_METRIC, table1_row

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


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("run") / "hf"
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", "kdn_diag", vocab_size=32000))
    model.save_pretrained(out)
    load_tokenizer("mistral-v1").save_pretrained(out)
    return out


def test_lm_eval_runs_local_tasks_offline(exported: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    rows = [{"question": f"Question {i}: the sky is", "choices": [" blue.", " made of cheese and wires."],
             "label": i % 2} for i in range(6)]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": "And God said, Let there be light."}) + "\n")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "mc.yaml").write_text(MC_TASK.format(data=tmp_path / "mc.jsonl"))
    (tmp_path / "tasks" / "ppl.yaml").write_text(PPL_TASK.format(data=tmp_path / "text.jsonl"))
    report = evaluate.main([str(exported), "--tasks", "kdn_local_mc,kdn_local_ppl", "--include-path",
                            str(tmp_path / "tasks"), "--out", str(tmp_path / "eval.json"), "--device", "cpu"])
    assert 0.0 <= report["tasks"]["kdn_local_mc"]["acc"] <= 1.0
    assert math.isfinite(report["tasks"]["kdn_local_ppl"]["word_perplexity"])
    assert report["tasks"]["kdn_local_ppl"]["word_perplexity"] > 1.0
    assert json.loads((tmp_path / "eval.json").read_text()) == report


def test_shard_perplexity_is_the_token_weighted_model_loss(exported: Path, tmp_path: Path) -> None:
    src = tmp_path / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"Document {i}: " + "in the beginning " * (5 + i)}) + "\n"
                           for i in range(60)))
    shards = prepare(PrepareConfig(source="jsonl", paths=str(src), out_dir=str(tmp_path / "s"), val_fraction=0.3,
                                   num_workers=1, progress=False))
    report = evaluate.main([str(exported), "--ppl", str(shards), "--seq-len", "32", "--out",
                            str(tmp_path / "e.json"), "--device", "cpu"])
    model, _ = evaluate.load_model(exported, device="cpu")
    losses, counts = [], []
    with torch.no_grad():
        for batch in TokenLoader(shards, split="val", seq_len=32, batch_size=4):
            ids = batch["input_ids"]
            losses.append(float(model(input_ids=ids, labels=ids).loss))
            counts.append(ids.numel() - ids.shape[0])
    expected = sum(loss * n for loss, n in zip(losses, counts)) / sum(counts)
    assert report["perplexity"]["loss"] == pytest.approx(expected, rel=1e-6)
    assert report["perplexity"]["ppl"] == pytest.approx(math.exp(expected), rel=1e-6)


def test_table1_row_uses_the_papers_metrics() -> None:
    results = {t: {"acc": 0.5, "acc_norm": 0.6} for t in ACC_METRIC}
    results["wikitext"] = {"word_perplexity": 18.6}
    results["lambada_openai"].update(perplexity=14.2)
    row = table1_row(results)
    assert row["wiki_ppl"] == 18.6 and row["lmb_ppl"] == 14.2
    assert row["hellaswag_acc_norm"] == 60.0 and row["piqa_acc"] == 50.0
    assert row["avg"] == pytest.approx((4 * 50.0 + 2 * 60.0) / 6)
    assert "avg" not in table1_row({"piqa": {"acc": 0.7}})


def test_bad_invocations(tmp_path: Path, exported: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a Hugging Face model directory"):
        evaluate.main([str(tmp_path / "missing"), "--ppl", str(tmp_path)])
    with pytest.raises(SystemExit):
        evaluate.main([str(exported)])  # nothing to evaluate


@pytest.fixture(scope="module")
def probe_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("probe")
    src = tmp / "docs.jsonl"
    src.write_text("".join(json.dumps({"text": f"Verse {i}: and the earth was without form, and void. " * 3}) + "\n"
                           for i in range(80)))
    return prepare(PrepareConfig(source="jsonl", paths=str(src), out_dir=str(tmp / "s"), val_fraction=0.5,
                                 num_workers=1, progress=False))


def test_overwrite_probe_summarises_every_kdn_layer(exported: Path, probe_shards: Path, tmp_path: Path) -> None:
    report = evaluate.main([str(exported), "--overwrite", str(probe_shards), "--probe-seqs", "2", "--probe-len",
                            "16", "--out", str(tmp_path / "e.json"), "--device", "cpu"])
    model, _ = evaluate.load_model(exported, device="cpu")
    betas = evaluate.probe_beta_eff(model, probe_shards, n_seqs=2, seq_len=16)
    assert sorted(betas) == [0, 1] and all(b.shape == (2, 16, 2) for b in betas.values())
    pooled = torch.cat([b.flatten() for b in betas.values()]).double()
    assert (pooled >= 0).all() and (pooled < 1).all()
    summary = report["overwrite"]
    assert summary["pooled"]["mean"] == pytest.approx(float(pooled.mean()), rel=1e-6)
    assert summary["pooled"]["q50"] == pytest.approx(float(pooled.median()), abs=float(pooled.std()))
    assert summary["layers"]["1"]["head_means"] == pytest.approx(betas[1].double().mean((0, 1)).tolist(), rel=1e-6)
    assert (tmp_path / "e_beta_eff.png").stat().st_size > 0


def test_overwrite_probe_errors(exported: Path, probe_shards: Path, tmp_path: Path) -> None:
    model, _ = evaluate.load_model(exported, device="cpu")
    with pytest.raises(ValueError, match=r"fewer than world_size\*batch_size=200"):
        evaluate.probe_beta_eff(model, probe_shards, n_seqs=200, seq_len=16)
    attn = models.build_model(models.model_config("toy", "attn", vocab_size=32000)).eval()
    with pytest.raises(ValueError, match="no layer with an effective write strength"):
        evaluate.probe_beta_eff(attn, probe_shards, n_seqs=2, seq_len=16)
