"""eval.tables never leaves a refused table's files from an earlier invocation in --out beside the fresh ones."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_tables import lm_values, ruler_values, write_run

from eval.tables.__main__ import main
from eval.tables.render import EXTENSIONS


def files_of(out: Path, tid: str) -> list[str]:
    return sorted(p.name for p in out.glob(f"{tid}.*"))


def test_a_refused_table_removes_its_files_from_an_earlier_invocation(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "a", lm=lm_values(18.9, 50.0), ruler=ruler_values(40.0))
    write_run(runs, "b", mixer="gdn2", lm=lm_values(18.7, 51.0), ruler=ruler_values(41.0))
    assert main([str(runs), "--out", str(out)]) == 0
    assert files_of(out, "table2") == [f"table2.{e}" for e in sorted(EXTENSIONS)]
    capsys.readouterr()

    # a run evaluated with other RULER settings: Table 2 is refused, Table 1 is written with the new run
    write_run(runs, "c", mixer="kdn_diag", lm=lm_values(18.5, 52.0), ruler=ruler_values(50.0),
              ruler_settings={"samples_per_cell": 500})
    assert main([str(runs), "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "eval.tables: table2 not written: " in err and f"(the earlier table2.* in {out} are removed)\n" in err
    assert files_of(out, "table2") == []
    assert str(runs / "c") in json.loads((out / "table1.json").read_text())["runs"]  # the fresh tables are there
    assert "table2: not written: " in (out / "missing.txt").read_text()
    assert main([str(runs), "--out", str(out)]) == 1  # refused again: nothing of it to remove, and no claim it was
    assert "are removed" not in capsys.readouterr().err


def test_a_refused_mqar_table_removes_its_files_and_says_so_in_missing_txt(tmp_path: Path) -> None:
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "a", lm=lm_values(18.9, 50.0))
    out.mkdir()
    for ext in EXTENSIONS:  # what an earlier invocation wrote from a good results file
        (out / f"mqar_recall.{ext}").write_text("kda 61.2\n")
    (out / "missing.txt").write_text("")
    bad = runs / "mqar" / "x" / "mqar.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("[1, 2]")
    with pytest.raises(SystemExit) as refusal:
        main([str(runs), "--out", str(out)])
    assert files_of(out, "mqar_recall") == []
    assert str(refusal.value).startswith(f"eval.tables: mqar_recall: {bad} is not an MQAR results file")
    assert str(refusal.value).endswith(f"(the earlier mqar_recall.* in {out} are removed)")
    assert f"mqar_recall: not written: {bad} is not an MQAR results file" in (out / "missing.txt").read_text()
    assert (out / "table1.md").is_file()


def test_curves_of_an_earlier_invocation_are_removed_when_no_run_has_training_records(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trained, untrained, out = tmp_path / "trained", tmp_path / "untrained", tmp_path / "out"
    write_run(trained, "a", lm=lm_values(18.9, 50.0),
              metrics=[json.dumps({"step": 10 * i, "tokens": 1000 * i, "loss": 5.0 - 0.1 * i}) for i in range(1, 4)])
    main([str(trained), "--out", str(out)])
    assert (out / "loss_curves.png").exists()
    capsys.readouterr()
    write_run(untrained, "b", lm=lm_values(18.7, 51.0))
    main([str(untrained), "--out", str(out)])
    assert not (out / "loss_curves.png").exists(), "curves of other runs left beside the fresh tables"
    assert "no run has training records" in capsys.readouterr().err


def test_an_earlier_folders_mqar_table_is_removed_when_the_new_folder_has_none(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    runs, out = tmp_path / "runs", tmp_path / "out"
    write_run(runs, "a", lm=lm_values(18.9, 50.0))
    out.mkdir()
    for ext in EXTENSIONS:  # what an invocation on another folder, which had an mqar.json, wrote
        (out / f"mqar_recall.{ext}").write_text("kda 61.2\n")
    assert main([str(runs), "--out", str(out)]) == 0
    assert files_of(out, "mqar_recall") == []
    line = (f"mqar_recall: not written: no mqar.json under {runs} (give --mqar FILE); the earlier mqar_recall.* in "
            f"{out} are removed")
    assert line in capsys.readouterr().err.splitlines()
    assert line in (out / "missing.txt").read_text().splitlines()
    assert main([str(runs), "--out", str(out)]) == 0  # nothing left to remove: no claim that anything was
    assert "mqar_recall" not in capsys.readouterr().err
