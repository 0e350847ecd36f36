"""eval.tables' MQAR recall table: results JSONs written through eval.mqar's own writers -> cells (mean, std, n),
the learning rate chosen over merged seeds, paired Δ, missing cells, refusals of mixed budgets and bad files, CLI."""
from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest

from common import write_json_atomic
from eval.mqar import build_jobs, flatten, model_config, parse_overrides, state_elements, summarize
from eval.mqar.run import SCHEMA, header
from eval.tables import SettingsMismatch, as_json, build_mqar_table, csv_text, latex, markdown, read_mqar
from eval.tables.__main__ import main
from eval.tables.mqar import MATCHED, UNMATCHED

MIXERS = ("kda", "kdn_diag", "kdn_diag/mu=1", "attn")
BASE = {"kda": 0.60, "kdn_diag": 0.70, "kdn_diag/mu=1": 0.50, "attn": 0.90}
LRS = (1e-3, 1e-2)


def acc_valid(mixer: str, lr: float, seed: int) -> float:
    """lr 1e-3 wins for every mixer, except kdn_diag/mu=1 at seed 2, whose 1e-2 lead outweighs seeds 0 and 1."""
    if mixer == "kdn_diag/mu=1":
        return BASE[mixer] + (0.3 if lr == 1e-2 else 0.0) if seed == 2 else BASE[mixer] + (0.02 if lr == 1e-3 else 0)
    return BASE[mixer] + 0.01 * seed - (0.05 if lr == 1e-2 else 0.0)


def acc_test(mixer: str, setting: str, width: int, lr: float, seed: int) -> float:
    return acc_valid(mixer, lr, seed) - 0.03 + 0.007 * seed ** 2 + width / 1e4 + (0.004 if setting == "128x8" else 0)


def write_results(path: Path, argv: list[str], drop: tuple[str, int] | None = None) -> Path:
    """An MQAR results JSON as ``python -m eval.mqar`` composes it (header, flatten, summarize, write_json_atomic),
    from job results of the accuracies above; ``drop``: a ``(mixer, width)`` whose jobs failed."""
    cfg, _ = parse_overrides([f"lrs={','.join(map(str, LRS))}", *argv, "preset=cpu", f"out={path.parent}",
                              f"results={path}"])
    records, failed = [], []
    for j in build_jobs(cfg):
        if drop == (j.mixer.label, j.width):
            failed.append({"job": j.name, "error": "RuntimeError: out of memory"})
            continue
        model = model_config(j.mixer, j.width, cfg.head_dim, cfg.vocab_size)
        scores = [{"setting": s.name, "valid_acc": acc_valid(j.mixer.label, j.lr, j.seed),
                   "test_acc": acc_test(j.mixer.label, s.name, j.width, j.lr, j.seed),
                   **dict(zip(("state", "state_recurrent"), state_elements(model, s.seq_len)))} for s in j.settings]
        records += flatten({"mixer": j.mixer.label, "width": j.width, "lr": j.lr, "seed": j.seed, "records": scores,
                            "curve": [], "final_loss": 1.5, "diverged": False, "steps": 200, "total_steps": 200,
                            "num_heads": j.width // 64, "head_dim": 64, "params": 12345, "train_s": 2.0,
                            "wall_s": 2.5})
    data = {**header(cfg, 10.0, "abc123"), "jobs_wall_s": 2.5 * len(records), "failed_jobs": failed,
            "rows": summarize(records, cfg), "jobs": sorted(records, key=lambda r: (
                r["setting"], r["mixer"], r["width"], r["lr"], r["seed"]))}
    write_json_atomic(path, data)
    return path


GRID = ["widths=64,128", "settings=64x4,128x8"]


@pytest.fixture
def two_files(tmp_path: Path) -> tuple[Path, Path]:
    """Seeds 0, 1 of every mixer (attn's d128 jobs failed) and, run separately, seed 2 of the KDN rows."""
    a = write_results(tmp_path / "runs" / "mqar" / "a" / "mqar.json",
                      [f"mixers={','.join(MIXERS)}", *GRID, "seeds=0,1"], drop=("attn", 128))
    b = write_results(tmp_path / "runs" / "mqar" / "b" / "mqar.json", ["mixers=kdn_diag,kdn_diag/mu=1", *GRID,
                                                                       "seeds=2"])
    return a, b


def expected(mixer: str, setting: str, width: int, seeds: list[int]) -> list[float]:
    """Per-seed test accuracy (%) at the rate with the best mean validation accuracy over ``seeds``."""
    best = max(LRS, key=lambda lr: sum(acc_valid(mixer, lr, s) for s in seeds) / len(seeds))
    return [100 * acc_test(mixer, setting, width, best, s) for s in seeds]


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def rows_of(table: Any) -> dict[tuple[str, str], Any]:
    """``(group label, row label) -> row``; a Δ row is keyed ``("Δ", its mixer)``."""
    out = {}
    for g in table.groups:
        for r in g.rows:
            out[("Δ", r.key) if r.kind == "diff" else (g.label, r.label)] = r
    return out


def test_cells_merge_seeds_and_rechoose_the_learning_rate(two_files: tuple[Path, Path]) -> None:
    table = build_mqar_table(read_mqar(list(two_files)))
    assert [c.header for c in table.columns] == ["64x4 d64", "64x4 d128", "128x8 d64", "128x8 d128"]
    assert [g.label for g in table.groups] == [MATCHED, UNMATCHED]
    rows = rows_of(table)
    for mixer, seeds in (("kda", [0, 1]), ("kdn_diag", [0, 1, 2]), ("kdn_diag/mu=1", [0, 1, 2])):
        for s in ("64x4", "128x8"):
            for w in (64, 128):
                cell = rows[(MATCHED, mixer)].cells[f"{s}/d{w}"]
                xs = expected(mixer, s, w, seeds)
                m = sum(xs) / len(xs)
                sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))
                assert (cell.n, cell.seeds) == (len(seeds), seeds)
                assert rel(cell.mean, m) < 1e-12 and rel(cell.std, sd) < 1e-12
                assert cell.text() == f"{m:.2f} ± {sd:.2f} (n={len(seeds)})"
    # seed 2 moves kdn_diag/mu=1 to lr 1e-2: its seed-0 value is the 1e-2 one, which file a alone would not pick
    mu1 = rows[(MATCHED, "kdn_diag/mu=1")].cells["64x4/d64"]
    assert rel(mu1.values[0], 100 * acc_test("kdn_diag/mu=1", "64x4", 64, 1e-2, 0)) < 1e-12
    alone = rows_of(build_mqar_table(read_mqar([two_files[0]])))[(MATCHED, "kdn_diag/mu=1")].cells["64x4/d64"]
    assert rel(alone.values[0], 100 * acc_test("kdn_diag/mu=1", "64x4", 64, 1e-3, 0)) < 1e-12
    assert rows[(MATCHED, "kdn_diag")].cells["128x8/d128"].bold  # highest matched-state mean in every column
    assert not any(c is not None and c.bold for c in rows[(UNMATCHED, "attn")].cells.values())  # alone in its group


def test_paired_difference_against_kda(two_files: tuple[Path, Path]) -> None:
    table = build_mqar_table(read_mqar(list(two_files)))
    rows = rows_of(table)
    diff = rows[("Δ", "kdn_diag")]
    assert diff.label == "Δ vs kda"
    for s in ("64x4", "128x8"):
        for w in (64, 128):
            cell = diff.cells[f"{s}/d{w}"]
            d = [a - b for a, b in zip(expected("kdn_diag", s, w, [0, 1, 2])[:2], expected("kda", s, w, [0, 1]))]
            m = sum(d) / 2
            assert cell.seeds == [0, 1] and cell.values == pytest.approx(d, rel=1e-12)  # seed 2: no kda to pair
            assert cell.text() == f"{m:+.2f} ± {abs(d[0] - d[1]) / math.sqrt(2):.2f} (n=2)"
    assert ("Δ", "attn") not in rows and ("Δ", "kda") not in rows
    other = rows_of(build_mqar_table(read_mqar(list(two_files)), reference="kdn_diag"))
    assert other[("Δ", "kda")].label == "Δ vs kdn_diag" and ("Δ", "kdn_diag") not in other
    assert not any(r.kind == "diff" for g in build_mqar_table(read_mqar(list(two_files)), diffs=False).groups
                   for r in g.rows)
    none = build_mqar_table(read_mqar(list(two_files)), reference="gdn")
    assert "no Δ rows: the reference gdn has no result" in none.spec.note


def test_missing_cells_failed_jobs_and_state_note(two_files: tuple[Path, Path]) -> None:
    table = build_mqar_table(read_mqar(list(two_files)))
    attn = rows_of(table)[(UNMATCHED, "attn")].cells
    assert attn["64x4/d128"] is None and attn["128x8/d128"] is None and attn["128x8/d64"] is not None
    assert len(table.missing) == 2
    assert table.missing[0].startswith("mqar_recall / attn / 64x4 d128, 128x8 d128: ")
    assert "mixers=attn widths=128 with the grid's other keys" in table.missing[0] and "settings=" not in \
        table.missing[0]  # test-only settings passed as settings= would train another mixture
    assert table.missing[1].startswith(f"mqar_recall / {two_files[0]}: 4 failed job(s), e.g. attn_d128_")
    states = {w: (2 * (w // 64) * 64 * 64, 2 * (w // 64) * 64 * 64 + 2 * w) for w in (64, 128)}  # KDA, Diagonal KDN
    assert "; ".join(f"d{w} {lo:,}–{hi:,}" for w, (lo, hi) in states.items()) in table.spec.note
    assert "(of 0.001, 0.01)" in table.spec.note and table.runs == [str(p) for p in two_files]
    md = markdown(table)
    assert "| kdn_diag/mu=1 |" in md and "| Δ vs kda |" in md and "—: no result (2 missing)" in md
    assert r"kdn\_diag/mu=1 &" in latex(table) and r"$\Delta$ vs kda" in latex(table)
    assert csv_text(table).splitlines()[0] == "group,model,kind,64x4 d64,64x4 d128,128x8 d64,128x8 d128"


def test_mixed_budgets_and_duplicate_jobs_are_refused(tmp_path: Path, two_files: tuple[Path, Path]) -> None:
    a = two_files[0]
    small = write_results(tmp_path / "c" / "mqar.json", ["mixers=kdn_diag", "widths=64", "settings=64x4", "seeds=5",
                                                         "train_examples=3200"])
    with pytest.raises(SettingsMismatch, match=r"setting 64x4 differs .* in train_mix \(\[\['64x4', 6400\], ") as err:
        build_mqar_table(read_mqar([a, small]))
    assert "\n" not in str(err.value) and str(small) in str(err.value)
    sweep = write_results(tmp_path / "d" / "mqar.json", ["mixers=kdn_diag", "widths=64", "settings=64x4", "seeds=5",
                                                          "batch_tokens=512", "lrs=0.001,0.003"])
    with pytest.raises(SettingsMismatch, match=r"in batch_tokens \(2048 vs 512\), lrs \(\[0.001, 0.01\] vs "
                                               r"\[0.001, 0.003\]\), train_mix"):
        build_mqar_table(read_mqar([a, sweep]))
    # another setting with another budget shares no column with a's rows: accepted
    other = write_results(tmp_path / "e" / "mqar.json", ["mixers=kda", "widths=64", "settings=256x16", "seeds=0",
                                                         "train_examples=3200"])
    table = build_mqar_table(read_mqar([a, other]))
    assert table.columns[-1].header == "256x16 d64" and rows_of(table)[(MATCHED, "kda")].cells["256x16/d64"].n == 1
    copy = tmp_path / "copy" / "mqar.json"
    copy.parent.mkdir()
    shutil.copy(a, copy)
    with pytest.raises(ValueError, match=r"both hold the job 128x8 attn d64 lr 0.001 seed 0; pass only one"):
        build_mqar_table(read_mqar([a, copy]))
    assert len(read_mqar([a, a, a.parent])) == 1  # one file named three ways is read once


def test_bad_files_get_one_line_errors(tmp_path: Path, two_files: tuple[Path, Path]) -> None:
    not_json = tmp_path / "torn.json"
    not_json.write_text(two_files[0].read_text()[:200])
    lm = tmp_path / "lm.json"
    lm.write_text(json.dumps({"schema": 1, "suite": "lm", "results": {}}))
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    no_jobs = tmp_path / "nojobs.json"
    no_jobs.write_text(json.dumps({k: v for k, v in json.loads(two_files[0].read_text()).items() if k != "jobs"}))
    (tmp_path / "empty").mkdir()
    for path, match in ((not_json, "is not valid JSON .* rerun the python -m eval.mqar command"),
                        (lm, f"is not an MQAR results file of schema {SCHEMA}"),
                        (listed, "is not an MQAR results file"),
                        (tmp_path / "absent.json", "cannot read .*absent.json"),
                        (no_jobs, "has no 'jobs' records"), (tmp_path / "empty", "no mqar.json under")):
        with pytest.raises(ValueError, match=match) as err:
            read_mqar([path])
        assert "\n" not in str(err.value)


def test_cli_writes_the_mqar_table_beside_tables_1_to_5(tmp_path: Path, two_files: tuple[Path, Path],
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    runs, out = two_files[0].parents[2], tmp_path / "out"
    assert main([str(runs), "--out", str(out)]) == 0  # both files found under RUNS_DIR
    assert "mqar_recall: 2 missing cell" in capsys.readouterr().err
    for ext in ("md", "tex", "csv", "json"):
        assert (out / f"mqar_recall.{ext}").stat().st_size > 0 and (out / f"table1.{ext}").stat().st_size > 0
    data = json.loads((out / "mqar_recall.json").read_text())
    assert [r["label"] for r in data["groups"][0]["rows"]] == ["kda", "kdn_diag", "Δ vs kda", "kdn_diag/mu=1",
                                                               "Δ vs kda"]
    cell = data["groups"][0]["rows"][1]["cells"]["128x8/d64"]
    xs = expected("kdn_diag", "128x8", 64, [0, 1, 2])
    assert cell["seeds"] == [0, 1, 2]
    assert rel(cell["mean"], sum(xs) / 3) < 1e-12 and cell["values"] == pytest.approx(xs, rel=1e-12)
    assert "mqar_recall / attn / 64x4 d128, 128x8 d128" in (out / "missing.txt").read_text()
    assert "experiment=table1_750m_kda" in (out / "missing.txt").read_text()  # Tables 1-5 keep theirs
    only = tmp_path / "only"
    assert main(["--mqar", str(two_files[0]), "--mqar-reference", "kdn_diag", "--out", str(only)]) == 0
    assert "mqar_recall: 2 missing cell" in capsys.readouterr().err
    assert "| Δ vs kdn_diag |" in (only / "mqar_recall.md").read_text() and not (only / "table1.md").exists()
    assert as_json(build_mqar_table(read_mqar([two_files[0]])))["runs"] == [str(two_files[0])]
    write_results(runs / "mqar" / "other" / "mqar.json", ["mixers=kda", "widths=64", "settings=64x4", "seeds=7",
                                                          "epochs=2"])
    (out / "table1.md").unlink()
    refusal = r"eval.tables: mqar_recall: setting 64x4 differs .* epochs \(1 vs 2\)"
    with pytest.raises(SystemExit, match=refusal):
        main([str(runs), "--out", str(out)])
    assert (out / "table1.md").is_file()  # the other tables are written before the refusal
    with pytest.raises(SystemExit):
        main(["--mqar", str(two_files[0]), "--tables", "table1", "--out", str(out)])


def test_the_arms_of_the_init_and_precision_experiment_are_rows_of_their_own(tmp_path: Path) -> None:
    argv = ["mixers=kda,kdn_diag", "widths=64", "settings=64x4", "seeds=0,1"]
    default = write_results(tmp_path / "arms" / "mqar.json", argv)
    arm = write_results(tmp_path / "arms" / "mqar_init-authors_fp32.json", [*argv, "init=authors", "precision=fp32"])
    table = build_mqar_table(read_mqar([default, arm]))
    labels = {label for _, label in rows_of(table)}
    assert {"kda", "kdn_diag", "kda_init-authors", "kdn_diag_init-authors_fp32"} <= labels
    cell = next(r for (_, label), r in rows_of(table).items() if label == "kdn_diag_init-authors_fp32").cells
    assert cell["64x4/d64"].n == 2  # its own two seeds, not merged with the default arm's
