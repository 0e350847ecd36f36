"""eval.tables over the runs a user has: the table of your runs (the README's demo run included), the runs that
matched no paper row in missing.txt, one plain line per missing-cell summary, and runs still being written."""
from __future__ import annotations

import csv
import io
import json
import warnings
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from test_tables import lm_values, ruler_values, write_run
from toy_run import make_cfg

from eval.results import suite_payload
from eval.tables import TABLES
from eval.tables.__main__ import main
from eval.tables.render import latex_text
from eval.tables.yours import COLUMNS

DEMO = "small_recurrent_kdn_diag"
DEMO_CELLS = {f"{t}@{n}": 5.0 + i for i, (t, n) in enumerate(
    (t, n) for t in ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1") for n in (1024, 2048))}
KJV = {"name": "kjv", "source": "kjv", "sha256": "cd34", "paper": False}


@pytest.fixture(scope="module")
def demo_config() -> str:
    """config.yaml of `python3 train.py` (the README's demo run), as train.py writes it."""
    return OmegaConf.to_yaml(OmegaConf.structured(make_cfg([])))


def write_demo(root: Path, config: str) -> Path:
    """runs/small_recurrent_kdn_diag after `python3 train.py` and `python evaluate.py model=... preset=quick`."""
    run = root / DEMO
    (run / "eval").mkdir(parents=True)
    (run / "config.yaml").write_text(config)
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 9.0 - s / 60, "tokens": 1024 * s}) + "\n"
                                               for s in (10, 60, 120)))
    model = {"run_dir": str(run), "name": DEMO, "mixer": "kdn_diag", "size": "small", "pattern": "recurrent",
             "mixer_options": {"mu": "dk", "noise": "learned", "alpha_param": "kda"}, "parameters": 20_100_000,
             "tokens_trained": 122880, "seed": 0, "step": 120}
    settings = {"lengths": [1024, 2048], "samples_per_cell": 20, "seed": 0, "haystack": KJV, "max_new_tokens": 128}
    body = suite_payload("ruler", model, {"sha256": "d3" * 32, "files": {}}, settings,
                         {c: {"score": s, "n": 20} for c, s in DEMO_CELLS.items()},
                         {"mean": sum(DEMO_CELLS.values()) / 8, "cells": 8}, 300.0, "cpu")
    (run / "eval" / "ruler.json").write_text(json.dumps(body))
    return run


def test_the_demo_run_and_every_evaluated_run_are_tabulated(tmp_path: Path, demo_config: str,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    runs, out = tmp_path / "runs", tmp_path / "tables"
    write_demo(runs, demo_config)
    write_run(runs, "diag750", mixer="kdn_diag", lm=lm_values(18.6, 52.0))  # a paper preset's run
    write_run(runs, "mu1_small", size="small", mixer="kdn_diag", mu="1")  # trained, not evaluated
    assert main([str(runs), "--paper", "--out", str(out)]) == 0
    mean = f"{sum(DEMO_CELLS.values()) / 8:.2f} (8 cells)"
    md = (out / "your_runs.md").read_text()
    demo_md = next(ln for ln in md.splitlines() if ln.startswith(f"| {DEMO} |"))
    assert "| kdn_diag mu=dk noise=learned alpha_param=kda | small (20.10M params) | recurrent |" in demo_md
    assert f"| 122.88K | none | — | — | {mean} |" in demo_md
    assert "ruler: kjv haystack sha256 cd34 (not the paper's), 20/cell, seed 0" in demo_md
    assert "| diag750 |" in md and "| table1, table2, table4 |" in md and "mu1_small" not in md
    rows = {r[0]: dict(zip(COLUMNS, r)) for r in csv.reader(io.StringIO((out / "your_runs.csv").read_text()))}
    assert rows[DEMO]["RULER"] == mean and rows[DEMO]["Paper tables"] == "none" and set(rows) == {
        "Run", DEMO, "diag750"}
    assert rows["diag750"]["LM avg"] == f"{52.0 + 2.5:.2f}" and rows["diag750"]["Wiki. ppl"] == "18.60"
    tex = (out / "your_runs.tex").read_text()
    assert f"{latex_text(DEMO)} & {latex_text('kdn_diag mu=dk')}" in tex and latex_text(mean) in tex
    data = json.loads((out / "your_runs.json").read_text())
    assert [r["Run"] for r in data["rows"]] == ["diag750", DEMO] and data["rows"][1]["RULER"] == mean
    missing = (out / "missing.txt").read_text().splitlines()
    unmatched = [m for m in missing if "matched no paper row" in m]
    assert len(unmatched) == 2
    demo_line = next(m for m in unmatched if DEMO in m)
    assert "small/recurrent/kdn_diag" in demo_line and "differs in size (small vs " in demo_line
    assert "not evaluated yet" in next(m for m in unmatched if "mu1_small" in m)
    assert "closest preset table4_mu_1 differs in size (small vs 750m)" in next(m for m in unmatched
                                                                               if "mu1_small" in m)
    assert "2 run(s) matched no paper row" in capsys.readouterr().err


def test_an_empty_folder_says_so_in_a_few_plain_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (tmp_path / "runs").mkdir()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main([str(tmp_path / "runs"), "--paper", "--out", str(tmp_path / "out")]) == 0
    assert [str(w.message) for w in caught if "eval/tables" in w.filename] == []
    err = capsys.readouterr().err.splitlines()
    assert len(err) <= len(TABLES) + 2, err  # a line per table, the empty folder, where the list is
    for tid in TABLES:
        assert sum(line.startswith(f"{tid}: ") for line in err) == 1
    assert not any("warn" in line.lower() or ".py:" in line for line in err)
    assert len((tmp_path / "out" / "missing.txt").read_text().splitlines()) > 40  # the full list is kept there
    assert "no evaluated run" in (tmp_path / "out" / "your_runs.md").read_text()


def test_runs_still_being_written_are_skipped_in_one_line_each(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "kda", lm=lm_values(18.9, 50.0), ruler=ruler_values(40.0))
    writing = write_run(runs, "diag", mixer="kdn_diag", lm=lm_values(18.6, 52.0), ruler=ruler_values(60.0),
                        metrics=[json.dumps({"step": 10, "tokens": 1000, "loss": 5.0}), '{"step": 20, "lo'])
    half = writing / "eval" / "ruler.json"
    half.write_text(half.read_text()[:200])  # a results file copied or written half-way
    config = write_run(runs, "iso", mixer="kdn_iso", lm=lm_values(18.4, 51.0)) / "config.yaml"
    config.write_text(config.read_text()[:40] + "\n  - [")  # train.py writing its config.yaml
    torn_first = ['{"step": 10, "lo', json.dumps({"step": 20, "tokens": 2, "loss": 4.0})]
    metrics = write_run(runs, "mimo", mixer="mamba3_mimo", lm=lm_values(19.0, 49.0), metrics=torn_first)
    metrics = metrics / "metrics.jsonl"
    empty = write_run(runs, "gdn2", mixer="gdn2") / "config.yaml"
    empty.write_text("")  # created, not yet written
    assert main([str(runs), "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "Traceback" not in err
    for bad in (half, writing / "metrics.jsonl", config, metrics, empty):
        lines = [ln for ln in err.splitlines() if str(bad) in ln]
        assert len(lines) == 1 and lines[0].startswith("skipped"), (bad, err)
    t1 = json.loads((out / "table1.json").read_text())
    filled = {r["label"] for r in t1["groups"][0]["rows"] if r["kind"] == "ours" and r["cells"]["wiki_ppl"]}
    assert filled == {"KDA", "Diagonal KDN", "Mamba-3 MIMO"}  # an unreadable config leaves its run out
    t2 = json.loads((out / "table2.json").read_text())
    ruler = {r["label"]: r["cells"]["mean"] for r in t2["groups"][0]["rows"] if r["kind"] == "ours"}
    assert ruler["KDA"] is not None and ruler["Diagonal KDN"] is None
    assert str(half) in (out / "missing.txt").read_text()
    assert f"| {writing} | 750m/recurrent/kdn_diag" in (out / "runs.md").read_text()
