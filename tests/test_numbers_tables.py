"""What a table cell is made of, checked by value: a non-finite result (a diverged evaluation) is a missing cell,
never a NaN in the seed mean; where a run holds a suite both in ``eval/`` and in its export's ``hf/eval/``, the
run's own file gives the numbers."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
from test_tables import lm_values, write_run

from eval.tables import TABLES, build_table, find_runs, markdown
from eval.tables.runs import load_run


def test_a_non_finite_result_is_missing_not_averaged(tmp_path: Path) -> None:
    """Three seeds of KDA, one with a NaN and one with an infinite WikiText perplexity: the cell is seed 0 alone."""
    for seed, wiki in ((0, 18.9), (1, float("nan")), (2, float("inf"))):
        write_run(tmp_path, f"kda_s{seed}", seed=seed, lm=lm_values(wiki, 50.0 + seed))
    table = build_table(TABLES["table1"], find_runs(tmp_path))
    kda = next(r for r in table.groups[0].rows if r.label == "KDA")
    cell = kda.cells["wiki_ppl"]
    assert (cell.values, cell.seeds) == ([18.9], [0])
    assert math.isfinite(cell.mean) and cell.text() == "18.90"
    assert kda.cells["piqa"].values == pytest.approx([51.0, 52.0, 53.0])  # the finite columns keep every seed
    for seed in (1, 2):
        assert any(f"kda_s{seed}: eval/lm.json has no wiki_ppl" in m for m in table.missing)
    assert "nan" not in markdown(table).lower()


def test_the_runs_own_results_win_over_its_exports(tmp_path: Path) -> None:
    """``eval/lm.json`` (WikiText 18.2) and a stale ``hf/eval/lm.json`` (25.0): the run reads 18.2, both orders of
    discovery alike, and says which one it used."""
    run = write_run(tmp_path, "kda_s0", lm=lm_values(25.0, 50.0))
    (run / "hf" / "eval").mkdir(parents=True)
    shutil.move(run / "eval" / "lm.json", run / "hf" / "eval" / "lm.json")
    own = write_run(tmp_path / "own", "kda_s0", lm=lm_values(18.2, 50.0))
    shutil.copy(own / "eval" / "lm.json", run / "eval" / "lm.json")
    skipped: list[str] = []
    loaded = load_run(run, skipped)
    assert loaded is not None
    assert loaded.results["lm"]["summary"]["wiki_ppl"] == 18.2
    assert any("both eval/lm.json and hf/eval/lm.json exist" in s for s in skipped)
    (run_found,) = [r for r in find_runs(tmp_path, skipped) if r.path == run]
    assert json.loads((run / "hf" / "eval" / "lm.json").read_text())["summary"]["wiki_ppl"] == 25.0
    assert run_found.results["lm"]["summary"]["wiki_ppl"] == 18.2
