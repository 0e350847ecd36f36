"""Concurrent evaluations of one model share its results files: every finished cell of every process ends in the
file, a cell is computed once even when two processes ask for it, a cell claimed by a process that dies is taken
over (real processes, a stubbed cell function), and ``overwrite=true`` replaces only the cells it recomputes."""
from __future__ import annotations

import json
import logging
import multiprocessing as mp
import os
import signal
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import timeout_s

from eval.model_dir import Target
from eval.suites import Context, run_cells

SETTINGS = {"max_length": 64, "seed": 0, "samples_per_cell": 3}
SPAWN = mp.get_context("spawn")  # a clean interpreter per process, as two evaluate.py commands are
WEIGHTS = {"sha256": "5e" * 32, "files": {}}


def _evaluate(out_dir: str, cells: list[str], log: str, start: Any = None, both: Any = None, claimed: Any = None,
              waiting: Any = None) -> None:
    """One evaluation process: runs ``cells`` through :func:`run_cells`, appending each computed cell to ``log``
    and writing what ``run_cells`` returned to ``<log>.json``. ``start``: a barrier passed before ``run_cells``;
    ``both``: one that its first computed cell waits at (two evaluations computing at once); ``claimed``: an event
    set once a cell is being computed, which then never ends (the process is killed); ``waiting``: an event set
    when ``run_cells`` says it waits for a cell that another evaluation is computing."""
    ctx = Context(target=Target(Path(out_dir), None, Path(out_dir)), model=None, hf_tokenizer=None, tokenizer=None,
                  device=torch.device("cpu"), dtype="float32", max_length=64, attention_limit=None,
                  model_meta={"name": "toy"}, weights=WEIGHTS, progress=False)
    first = [True]

    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        with open(log, "a") as f:
            f.write(f"{cell}\n")
        if both is not None and first:
            first.clear()
            both.wait(timeout_s(120))
        if claimed is not None:
            claimed.set()
            signal.pause()
        return {"score": 10.0 + len(cell), "pid": os.getpid()}, []

    if waiting is not None:
        class Waiting(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                if "waiting for" in record.getMessage():
                    waiting.set()

        logging.getLogger("evaluate").addHandler(Waiting())
        logging.getLogger("evaluate").setLevel(logging.INFO)
    if start is not None:
        start.wait(timeout_s(120))
    rep = run_cells(ctx, "ruler", dict(SETTINGS), cells, run_cell, lambda res: {"cells": len(res)})
    Path(f"{log}.json").write_text(json.dumps(rep))


def _computed(log: Path) -> list[str]:
    return log.read_text().split() if log.is_file() else []


def _run_pair(tmp_path: Path, cells_a: list[str], cells_b: list[str]) -> tuple[dict, dict]:
    start, both = SPAWN.Barrier(2), SPAWN.Barrier(2)
    procs = [SPAWN.Process(target=_evaluate, args=(str(tmp_path / "eval"), cells, str(tmp_path / name), start, both))
             for name, cells in (("a", cells_a), ("b", cells_b))]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout_s(120))
        assert p.exitcode == 0, f"an evaluation process failed (exit {p.exitcode})"
    return tuple(json.loads((tmp_path / f"{n}.json").read_text()) for n in "ab")  # type: ignore[return-value]


def test_two_evaluations_of_one_model_keep_each_others_cells(tmp_path: Path) -> None:
    a_cells, b_cells = ["niah_single_1@1024", "niah_single_1@2048"], ["niah_single_2@1024", "niah_single_2@2048"]
    _run_pair(tmp_path, a_cells, b_cells)
    final = json.loads((tmp_path / "eval" / "ruler.json").read_text())
    assert sorted(final["results"]) == sorted(a_cells + b_cells)
    assert final["summary"] == {"cells": 4}
    assert sorted(_computed(tmp_path / "a")) == sorted(a_cells)
    assert sorted(_computed(tmp_path / "b")) == sorted(b_cells)


def test_a_cell_asked_for_by_two_evaluations_is_computed_once(tmp_path: Path) -> None:
    """Both ask for the same cells; each computes its first cell while the other computes one (a barrier), so the
    cells are shared out between them."""
    cells = [f"niah_single_1@{n}" for n in (1024, 2048, 4096, 8192)]
    rep_a, rep_b = _run_pair(tmp_path, cells, cells)
    done = _computed(tmp_path / "a") + _computed(tmp_path / "b")
    assert sorted(done) == sorted(cells)  # each cell once, shared out between the two
    assert _computed(tmp_path / "a") and _computed(tmp_path / "b")
    assert list(rep_a["results"]) == cells and list(rep_b["results"]) == cells  # both report the whole suite
    on_disk = json.loads((tmp_path / "eval" / "ruler.json").read_text())["results"]
    assert {c: r["pid"] for c, r in on_disk.items()} == {c: r["pid"] for c, r in rep_a["results"].items()}


def _blocked_on_a_lock(pid: int) -> bool:
    """Whether ``pid`` waits for an ``flock`` that another process holds (a ``->`` line of /proc/locks)."""
    return any(f[1] == "->" and int(f[5]) == pid for f in (ln.split() for ln in Path("/proc/locks").read_text()
                                                            .splitlines()) if len(f) > 5)


@pytest.mark.skipif(not Path("/proc/locks").is_file(), reason="needs /proc/locks to see the evaluation wait")
def test_a_cell_claimed_by_a_killed_evaluation_is_taken_over(tmp_path: Path) -> None:
    """The second evaluation skips the cell that a live one computes, does its other cell, then waits (blocked on
    the cell's claim) until the first is killed, and computes the cell itself."""
    slow, quick = "niah_single_1@1024", "niah_single_1@2048"
    out, claimed, waiting = tmp_path / "eval", SPAWN.Event(), SPAWN.Event()
    holder = SPAWN.Process(target=_evaluate, args=(str(out), [slow], str(tmp_path / "a"), None, None, claimed))
    holder.start()
    try:
        assert claimed.wait(timeout_s(120)), "the first evaluation never started its cell"
        other = SPAWN.Process(target=_evaluate, args=(str(out), [slow, quick], str(tmp_path / "b"), None, None, None,
                                                      waiting))
        other.start()
        assert waiting.wait(timeout_s(120)), "the second evaluation did not wait for the claimed cell"
        deadline = time.monotonic() + timeout_s(120)
        while not _blocked_on_a_lock(other.pid):
            assert time.monotonic() < deadline and other.is_alive(), "the second evaluation did not wait for the lock"
            time.sleep(0.05)
        assert _computed(tmp_path / "b") == [quick] and (out / "ruler.json").is_file()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout_s(30))
    other.join(timeout_s(120))
    assert other.exitcode == 0
    assert _computed(tmp_path / "b") == [quick, slow]  # skipped the claimed cell first, took it over after the kill
    assert sorted(json.loads((out / "ruler.json").read_text())["results"]) == sorted([slow, quick])


def test_a_file_written_meanwhile_with_other_settings_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    out.mkdir()
    ctx = Context(target=Target(out, None, out), model=None, hf_tokenizer=None, tokenizer=None,
                  device=torch.device("cpu"), dtype="float32", max_length=64, attention_limit=None,
                  model_meta={"name": "toy"}, weights=WEIGHTS, progress=False)

    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        other = {"settings": {**SETTINGS, "samples_per_cell": 500}, "results": {"x@1": {"score": 1.0}}}
        (out / "ruler.json").write_text(json.dumps(other))  # another evaluation, started with other settings
        return {"score": 2.0}, []

    with pytest.raises(ValueError, match=r"written with other settings \(samples_per_cell\)"):
        run_cells(ctx, "ruler", dict(SETTINGS), ["y@1"], run_cell, lambda res: {})
    assert json.loads((out / "ruler.json").read_text())["results"] == {"x@1": {"score": 1.0}}


def test_an_overwrite_started_meanwhile_replaces_only_the_cells_it_recomputes(tmp_path: Path) -> None:
    out = tmp_path / "eval"
    first, second = ["a@1", "b@1", "c@1"], ["c@1", "d@1"]
    computed: list[tuple[str, str]] = []

    def ctx(overwrite: bool) -> Context:
        return Context(target=Target(out, None, out), model=None, hf_tokenizer=None, tokenizer=None,
                       device=torch.device("cpu"), dtype="float32", max_length=64, attention_limit=None,
                       model_meta={"name": "toy"}, weights=WEIGHTS, overwrite=overwrite, log_samples=True,
                       progress=False)

    def run(who: str, cells: list[str], overwrite: bool) -> dict[str, Any]:
        def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
            computed.append((who, cell))
            if (who, cell) == ("first", "b@1"):  # a second evaluation, with overwrite=true, starts meanwhile
                run("second", second, overwrite=True)
            return {"score": 1.0 + len(computed), "by": who}, [{"index": 0, "prediction": who}]

        return run_cells(ctx(overwrite), "ruler", dict(SETTINGS), cells, run_cell, lambda res: {"cells": len(res)})

    run("earlier", ["a@1", "c@1", "e@1"], overwrite=False)
    run("first", first, overwrite=True)
    assert computed == [("earlier", "a@1"), ("earlier", "c@1"), ("earlier", "e@1"), ("first", "a@1"),
                        ("first", "b@1"), ("second", "c@1"), ("second", "d@1")]  # "b@1" is the first's; "c@1"
    # was computed by the second after the first started, so the first does not compute it again
    final = json.loads((out / "ruler.json").read_text())
    assert {c: r["by"] for c, r in final["results"].items()} == {"a@1": "first", "b@1": "first", "c@1": "second",
                                                                 "d@1": "second", "e@1": "earlier"}
    rows = [json.loads(x) for x in (out / "ruler.samples.jsonl").read_text().splitlines()]
    assert {r["cell"]: r["prediction"] for r in rows} == {c: r["by"] for c, r in final["results"].items()}
    assert len(rows) == 5
