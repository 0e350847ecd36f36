"""bench.eval_speed at toy size on the CPU: every part runs, the report has its header and the time split."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import eval_speed


def test_eval_speed_runs_at_toy_size(tmp_path: Path) -> None:
    out = tmp_path / "speed.json"
    rep = eval_speed.main(["--size", "toy", "--samples-per-cell", "2", "--cells", "niah_single_1@1024",
                           "--ruler-new-tokens", "4", "--batch-size", "2", "--cloze-docs", "1", "--cloze-tokens",
                           "96", "--lm-scale", "0.0002", "--max-length", "256", "--wikitext-tokens", "600",
                           "--out", str(out)])
    assert json.loads(out.read_text()) == rep
    h = rep["header"]
    assert h["device"] == "cpu" and h["versions"]["torch"] and h["date"] and h["model"]["parameters"] > 0
    cell = rep["ruler"]["cells"]["niah_single_1@1024"]
    assert rep["ruler"]["samples"] == 2 and cell["prefill_s"] > 0 and cell["decode_s"] > 0
    assert cell["prefill_s"] + cell["decode_s"] <= cell["generate_s"] * 1.01
    assert rep["cloze"]["documents"] == 6 and rep["cloze"]["decode_s"] > 0
    assert set(rep["lm"]["tasks"]) == {*eval_speed.LM_SHAPES, "wikitext"}
    assert rep["lm"]["tasks"]["hellaswag"]["requests"] == 2 * 4 and rep["lm"]["tasks"]["wikitext"]["prefill_s"] > 0


@pytest.mark.gpu
def test_eval_speed_runs_on_cuda_in_bf16(tmp_path: Path) -> None:
    rep = eval_speed.main(["--size", "100m", "--samples-per-cell", "8", "--cells", "niah_single_2@4096",
                           "--cloze-docs", "4", "--lm-scale", "0.002", "--out", str(tmp_path / "s.json")])
    assert rep["header"]["dtype"] == "bfloat16" and rep["header"]["device"] != "cpu"
    assert rep["ruler"]["cells"]["niah_single_2@4096"]["decode_s"] > 0 and rep["cloze"]["documents"] == 24
