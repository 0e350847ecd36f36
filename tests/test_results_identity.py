"""A results file holds only cells of the weights and task definitions it names: a file that an evaluation of third
weights writes meanwhile is refused (not taken for the file being replaced), and a cell whose task's definition
version differs from the one it was computed at (or was never recorded) is computed again, RULER's ``task@length``
cells and the retrieval tasks included, through the path every suite takes (``run_cells``)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from eval_fixtures import export_toy_run
from test_eval_ruler_suite import TOK, _args, _use_oracle, queried_value
from test_evaluate_integrity import _ctx

import eval.ruler
import evaluate
from eval.suites import run_cells

W1, W2, W3 = "a1" * 32, "b2" * 32, "c3" * 32
SETTINGS = {"samples_per_cell": 3, "seed": 0}


def _run(out: Path, sha: str, cells: list[str], settings: dict[str, Any], computed: list[str], base: float,
         meanwhile: Any = None) -> dict[str, Any]:
    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        computed.append(cell)
        if meanwhile is not None:
            meanwhile()
        return {"score": base + len(computed)}, []

    return run_cells(_ctx(out, sha), "ruler", dict(settings), cells, run_cell, lambda res: {"cells": len(res)})


def test_a_file_written_meanwhile_by_an_evaluation_of_third_weights_is_refused(tmp_path: Path) -> None:
    _run(tmp_path, W1, ["x@1", "y@1"], SETTINGS, [], base=10.0)  # the file this evaluation replaces
    third = {"settings": SETTINGS, "weights": {"sha256": W3}, "results": {"z@1": {"score": 77.0}}}

    def third_writes() -> None:
        (tmp_path / "ruler.json").write_text(json.dumps(third))

    with pytest.raises(ValueError) as err:
        _run(tmp_path, W2, ["x@1"], SETTINGS, [], base=50.0, meanwhile=third_writes)
    assert str(err.value) == (f"{tmp_path / 'ruler.json'} was written meanwhile by an evaluation of other weights "
                              f"(sha256 {W3[:12]}; these are {W2[:12]}); evaluate one version of a model at a time, "
                              "or pass out_dir=<another folder>")
    assert json.loads((tmp_path / "ruler.json").read_text()) == third  # the third evaluation's cells are kept
    # the file being replaced, written again meanwhile by an evaluation of its own weights, is still replaced
    _run(tmp_path, W1, ["x@1", "y@1"], SETTINGS, [], base=10.0)
    computed: list[str] = []

    def first_adds() -> None:
        _run(tmp_path, W1, ["w@1"], SETTINGS, [], base=20.0)

    rep = _run(tmp_path, W2, ["x@1"], SETTINGS, computed, base=50.0, meanwhile=first_adds)
    assert computed == ["x@1"] and rep["weights"]["sha256"] == W2 and sorted(rep["results"]) == ["x@1"]


@pytest.mark.parametrize("recorded", [None, {"other_task": 1.0}], ids=["no-tasks", "task-missing"])
def test_a_cell_whose_task_had_no_version_recorded_is_computed_again(tmp_path: Path,
                                                                       recorded: dict | None) -> None:
    old = {"settings": {**SETTINGS, **({"tasks": recorded} if recorded is not None else {})},
           "weights": {"sha256": W1}, "results": {"swde": {"score": 41.0}}}
    (tmp_path / "ruler.json").write_text(json.dumps(old))
    computed: list[str] = []
    rep = _run(tmp_path, W1, ["swde"], {**SETTINGS, "tasks": {"swde": 2.0}}, computed, base=60.0)
    assert computed == ["swde"] and rep["results"]["swde"] == {"score": 61.0}
    assert rep["settings"]["tasks"]["swde"] == 2.0


@pytest.mark.parametrize("cells, tasks", [(["niah_single_1@1024", "niah_single_1@2048", "niah_single_2@1024"],
                                           ("niah_single_1", "niah_single_2")),
                                          (["swde", "squad"], ("swde", "squad"))], ids=["ruler", "retrieval"])
def test_a_cell_of_another_task_definition_is_computed_again_by_run_cells(
        tmp_path: Path, cells: list[str], tasks: tuple[str, str]) -> None:
    changed, same = tasks
    first: list[str] = []
    _run(tmp_path, W1, cells, {**SETTINGS, "tasks": {changed: 1.0, same: 1.0}}, first, base=10.0)
    assert first == cells
    computed: list[str] = []
    rep = _run(tmp_path, W1, cells, {**SETTINGS, "tasks": {changed: 2.0, same: 1.0}}, computed, base=30.0)
    assert computed == [c for c in cells if c.split("@")[0] == changed]  # only the changed task's cells
    assert rep["settings"]["tasks"] == {changed: 2.0, same: 1.0}
    assert all(rep["results"][c]["score"] > 30.0 for c in computed)
    assert json.loads((tmp_path / "ruler.json").read_text()) == rep


def test_the_ruler_suite_recomputes_a_task_whose_definition_version_changed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = export_toy_run(tmp_path / "run")
    _use_oracle(monkeypatch, lambda ids: TOK.encode(" " + queried_value(ids) + "."))
    built: list[str] = []
    real = eval.ruler.build_samples

    def counted(task: str, length: int, *args: Any, **kwargs: Any) -> Any:
        built.append(f"{task}@{length}")
        return real(task, length, *args, **kwargs)

    monkeypatch.setattr(eval.ruler, "build_samples", counted)
    out = tmp_path / "eval"
    evaluate.run(evaluate.compose(_args(run, out)))
    assert built == ["niah_single_1@1024", "niah_multikey_1@1024"]
    built.clear()
    monkeypatch.setitem(eval.ruler.VERSIONS, "niah_single_1", eval.ruler.VERSIONS["niah_single_1"] + 1)
    rep = evaluate.run(evaluate.compose(_args(run, out)))["reports"]["ruler"]
    assert built == ["niah_single_1@1024"]
    assert rep["settings"]["tasks"] == {"niah_single_1": eval.ruler.VERSIONS["niah_single_1"],
                                        "niah_multikey_1": eval.ruler.VERSIONS["niah_multikey_1"]}
    assert sorted(rep["results"]) == ["niah_multikey_1@1024", "niah_single_1@1024"]
