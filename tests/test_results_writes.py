"""The writes of evaluate.py's results that fail: a full disk while a cell is written gives one line naming the disk
and the fix, leaves no temp file and keeps the cells already there; a damaged line in ``<suite>.samples.jsonl``
gives one line naming the file and the way out."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from typing import Any

import pytest
from test_evaluate_integrity import _ctx

import common.io
from eval.suites import run_cells

SHA = "d4" * 32


def _run(out: Path, cells: list[str], log_samples: bool = False) -> dict[str, Any]:
    ctx = _ctx(out, SHA)
    ctx.log_samples = log_samples

    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        return {"score": 10.0 + len(cell)}, [{"index": 0, "prediction": "x", "score": 1.0}]

    return run_cells(ctx, "ruler", {"samples_per_cell": 3, "seed": 0}, cells, run_cell, lambda r: {})


def test_a_full_disk_while_a_cell_is_written_is_one_line_and_leaves_no_temp_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _run(tmp_path, ["a@1"])
    before = (tmp_path / "ruler.json").read_bytes()

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common.io.os, "fsync", full)
    with pytest.raises(ValueError) as err:
        _run(tmp_path, ["b@1"])
    said = str(err.value)
    assert "\n" not in said and err.value.__cause__ is None
    assert said == (f"writing {tmp_path / 'ruler.json'} failed: the disk is full at {tmp_path}; the cell b@1 is not "
                    f"recorded and the cells already in {tmp_path / 'ruler.json'} are kept; free space there and "
                    "rerun the command (finished cells are reused), or pass out_dir=<a folder on a disk with room>")
    assert (tmp_path / "ruler.json").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_file()) == ["ruler.json"]  # no temp file left


@pytest.mark.parametrize("log_samples", [True, False])
def test_a_damaged_line_of_the_samples_log_is_one_line_naming_the_file_and_the_way_out(
        tmp_path: Path, log_samples: bool) -> None:
    _run(tmp_path, ["a@1"], log_samples=True)
    log = tmp_path / "ruler.samples.jsonl"
    lines = log.read_text().splitlines()
    log.write_text("\n".join(["", *lines, "", '{"cell": "a@1", "ind'] + lines) + "\n")  # a damaged line 4 of 5
    with pytest.raises(ValueError) as err:
        _run(tmp_path, ["b@1"], log_samples=log_samples)
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"{log}:4 is not JSON (")
    assert "or move the file away: it holds only the per-sample records" in said
    assert sorted(json.loads((tmp_path / "ruler.json").read_text())["results"]) == ["a@1"]
    log.unlink()  # the way out it names
    assert sorted(_run(tmp_path, ["b@1"], log_samples=log_samples)["results"]) == ["a@1", "b@1"]
