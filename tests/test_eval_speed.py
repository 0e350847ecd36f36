"""bench.eval_speed at toy size on the CPU: every part runs, the report has its header and the time split; the
RULER grid runs at evaluate.py's default batch (auto: 8 on the CPU, a search per context length on CUDA) and
records the batches."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import models
from bench import eval_speed
from data import load_tokenizer


def test_eval_speed_runs_at_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    rep = eval_speed.main(["--size", "toy", "--samples-per-cell", "2", "--cells", "niah_single_1@1024",
                           "--ruler-new-tokens", "4", "--batch-size", "2", "--cloze-docs", "1", "--cloze-tokens",
                           "96", "--lm-scale", "0.0002", "--max-length", "256", "--wikitext-tokens", "600",
                           "--out", str(out)])
    assert json.loads(out.read_text()) == rep
    h = rep["header"]
    assert h["device"] == "cpu" and h["versions"]["torch"] and h["date"] and h["model"]["parameters"] > 0
    assert h["model"]["pattern"] == "recurrent"  # the default
    assert h["warmup_s"] > 0  # the first forwards, timed before the parts
    cell = rep["ruler"]["cells"]["niah_single_1@1024"]
    assert rep["ruler"]["samples"] == 2 and cell["prefill_s"] > 0 and cell["decode_s"] > 0
    assert cell["prefill_s"] + cell["decode_s"] <= cell["generate_s"] * 1.01
    assert rep["cloze"]["documents"] == 6 and rep["cloze"]["decode_s"] > 0
    assert set(rep["lm"]["tasks"]) == {*eval_speed.LM_SHAPES, "wikitext"}
    assert rep["lm"]["tasks"]["hellaswag"]["requests"] == 2 * 4 and rep["lm"]["tasks"]["wikitext"]["prefill_s"] > 0


def test_the_ruler_grid_runs_at_the_default_auto_batch_and_records_its_batches(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rep = eval_speed.main(["--size", "toy", "--parts", "ruler", "--samples-per-cell", "3", "--cells",
                           "niah_single_1@1024,niah_multikey_1@1024", "--ruler-new-tokens", "2", "--no-warmup",
                           "--pattern", "hybrid_swa", "--out", str(tmp_path / "s.json")])
    assert rep["header"]["model"]["pattern"] == "hybrid_swa"  # the model built and recorded is the one asked for
    assert "warmup_s" not in rep["header"]
    assert rep["header"]["batch_size"] == rep["header"]["lm_batch_size"] == 8  # auto on the CPU
    assert [c["batch_sizes"] for c in rep["ruler"]["cells"].values()] == [[3], [3]] and not rep["ruler"]["searches"]
    with pytest.raises(SystemExit):
        eval_speed.main(["--batch-size", "0"])
    assert "'0' is neither 'auto' nor a positive int" in capsys.readouterr().err
    torch.manual_seed(0)
    model = models.build_model(models.model_config("toy", "kdn_diag", vocab_size=32000)).eval()
    tok = load_tokenizer("mistral-v1")
    cells = ["niah_single_1@1024", "niah_multikey_1@1024", "niah_single_1@2048"]
    seen: list[list[str]] = []
    with torch.no_grad():  # auto as on CUDA: one search per context length, capped at a cell's samples
        r = eval_speed.bench_ruler(model, tok, eval_speed.ForwardClock(model, torch.device("cpu")), cells, 3, "auto",
                                   tok.eos_id, new_tokens=2,
                                   on_cell=lambda part: seen.append(list(part["cells"]) * (not part["complete"])))
    assert seen == [cells[:1], cells[:2], cells] and r["complete"]  # each finished cell reported as it ends
    assert {k: (v["batch_size"], v["done"], list(v["samples_per_s"])) for k, v in r["searches"].items()} == {
        "1024": (3, True, ["3"]), "2048": (3, False, ["3"])}  # 1024: two cells measured 3 rows, 6 > 3 samples
    assert [c["batch_sizes"] for c in r["cells"].values()] == [[3], [3], [3]]


@pytest.mark.gpu
def test_eval_speed_runs_on_cuda_in_bf16(tmp_path: Path) -> None:
    rep = eval_speed.main(["--size", "100m", "--samples-per-cell", "8", "--cells", "niah_single_2@4096",
                           "--cloze-docs", "4", "--lm-scale", "0.002", "--out", str(tmp_path / "s.json")])
    assert rep["header"]["dtype"] == "bfloat16" and rep["header"]["device"] != "cpu"
    assert rep["ruler"]["cells"]["niah_single_2@4096"]["decode_s"] > 0 and rep["cloze"]["documents"] == 24
