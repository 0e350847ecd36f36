"""eval.tables: synthetic run directories -> Tables 1-5 (seeds, bold, missing cells, settings), Fig. 4, loss curves."""
from __future__ import annotations

import csv
import io
import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf

from eval.tables import TABLES, SettingsMismatch, build_table, csv_text, find_runs, latex, markdown
from eval.tables.__main__ import main
from eval.tables.figures import loss_curves, throughput_figure
from eval.tables.specs import RETRIEVAL_TASKS, RULER_CELLS
from eval.tasks import VERSIONS
from models.sizes import GDN2_AUTHORS_LAYOUT

pytestmark = pytest.mark.filterwarnings("ignore:.*torn last line")
LM_KEYS = ("wiki_ppl", "lmb_ppl", "lambada_openai", "piqa", "hellaswag", "winogrande", "arc_easy", "arc_challenge")


def write_run(root: Path, name: str, *, size: str = "750m", mixer: str = "kda", pattern: str = "recurrent",
              mu: str | None = None, noise: str | None = None, seed: int = 0, data_seed: int = 0,
              lm: dict[str, float] | None = None, ruler: dict[str, float] | None = None,
              retrieval: dict[str, float] | None = None, ruler_settings: dict[str, Any] | None = None,
              retrieval_settings: dict[str, Any] | None = None, metrics: list[str] | None = None) -> Path:
    """A run directory as train.py and evaluate.py leave it (only the fields eval.tables reads, plus a few). RULER
    ran on KJV as older files record it (no haystack name or ``paper``); retrieval as the paper's protocol."""
    run = root / name
    (run / "eval").mkdir(parents=True)
    kdn = mixer.startswith("kdn")
    cfg = {"name": name, "seed": seed, "model": {"size": size, "overrides": {}},
           "mixer": {"name": mixer, "mu": mu or ("dk" if kdn else None), "noise": noise or ("learned" if kdn else None),
                     "alpha_param": "kda" if kdn else None,
                     "kwargs": dict(GDN2_AUTHORS_LAYOUT) if mixer == "gdn2" else {}},  # as the GDN-2 presets
           "backbone": {"pattern": pattern, "window": None}, "data": {"seed": data_seed, "seq_len": 4096}}
    OmegaConf.save(OmegaConf.create(cfg), run / "config.yaml")
    model = {"run_dir": str(run), "mixer": mixer, "size": size, "pattern": pattern, "seed": seed}
    base_settings = {"max_length": 4096, "seed": 0, "tokenizer_sha256": "ab12"}

    def suite(name: str, results: dict, summary: dict, settings: dict) -> None:
        body = {"schema": 1, "suite": name, "model": model, "settings": settings, "results": results,
                "summary": summary, "wall_time_s": 1.0, "date": "2026-12-01T10:00:00Z", "device": "cpu"}
        (run / "eval" / f"{name}.json").write_text(json.dumps(body))

    if lm is not None:
        accs = [lm[k] for k in LM_KEYS[2:] if k in lm]
        summary = {**lm, **({"avg": sum(accs) / 6} if len(accs) == 6 else {})}
        suite("lm", {"wikitext": {"word_perplexity": lm.get("wiki_ppl")}}, summary,
              {**base_settings, "limit": None, "num_fewshot": 0})
    if ruler is not None:
        settings = {**base_settings, "samples_per_cell": 20, "haystack": {"source": "kjv", "sha256": "cd34"},
                    **(ruler_settings or {})}
        suite("ruler", {c: {"score": s, "n": 20} for c, s in ruler.items()}, {"mean": 0.0, "cells": len(ruler)},
              settings)
    if retrieval is not None:
        suite("retrieval", {t: {"score": s, "n": 50} for t, s in retrieval.items()}, {},
              {**base_settings, "truncation": "jrt", "context_tokens": 2048, "limit": None, "max_new_tokens": 48,
               "tasks": dict(VERSIONS), **(retrieval_settings or {})})
    if metrics is not None:
        (run / "metrics.jsonl").write_text("\n".join(metrics))
    return run


def lm_values(wiki: float, acc: float) -> dict[str, float]:
    """Table 1 summary values: perplexities from ``wiki``, accuracies spread around ``acc``."""
    return {"wiki_ppl": wiki, "lmb_ppl": wiki - 3.5, **{k: acc + i for i, k in enumerate(LM_KEYS[2:])}}


def ruler_values(base: float) -> dict[str, float]:
    return {c: base + 0.5 * i for i, c in enumerate(RULER_CELLS)}


# seeds of 750M KDA and Diagonal KDN: wiki perplexity and base accuracy per seed
KDA_SEEDS = {0: (18.9, 50.0), 1: (18.7, 51.0), 2: (19.1, 50.5)}
DIAG_SEEDS = {0: (18.6, 52.0), 1: (18.5, 53.5), 3: (18.4, 52.5)}


@pytest.fixture
def runs_dir(tmp_path: Path) -> Path:
    root = tmp_path / "runs"
    for s, (w, a) in KDA_SEEDS.items():
        write_run(root, f"kda_s{s}", seed=s, lm=lm_values(w, a), ruler=ruler_values(40.0 + s),
                  metrics=[json.dumps({"step": 10 * i, "tokens": 1000 * i, "loss": 5.0 - 0.1 * i})
                           for i in range(1, 5)] + [json.dumps({"step": 20, "val_loss": 4.9})])
    for s, (w, a) in DIAG_SEEDS.items():
        write_run(root, f"diag_s{s}", mixer="kdn_diag", seed=s, lm=lm_values(w, a),
                  ruler=None if s == 3 else ruler_values(60.0 + s),
                  metrics=[json.dumps({"step": 10, "tokens": 1000, "loss": 5.1})]
                  + (['{"step": 20, "tok'] if s == 0 else []))
    write_run(root, "iso_s0", mixer="kdn_iso", lm={"wiki_ppl": 18.3, "lmb_ppl": 14.0}, ruler=ruler_values(70.0))
    return root


def test_seeds_give_mean_std_and_n_by_hand(runs_dir: Path) -> None:
    with pytest.warns(UserWarning, match="torn last line"):
        runs = find_runs(runs_dir)
    table = build_table(TABLES["table1"], runs)
    rows = {r.label: r for r in table.groups[0].rows}
    cell = rows["KDA"].cells["wiki_ppl"]
    xs = [w for w, _ in KDA_SEEDS.values()]
    m = sum(xs) / 3
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / 2)
    assert (cell.n, cell.seeds) == (3, [0, 1, 2])
    assert abs(cell.mean - m) / m < 1e-12 and abs(cell.std - sd) / sd < 1e-12
    assert cell.text() == f"{m:.2f} ± {sd:.2f} (n=3)"
    avg = rows["Diagonal KDN"].cells["avg"]  # the suite's six-accuracy mean, per seed
    assert avg.values == pytest.approx([a + 2.5 for _, a in DIAG_SEEDS.values()])
    assert rows["Isotropic KDN"].cells["wiki_ppl"].text() == "18.30"  # one seed: no spread


def test_paired_difference_uses_common_seeds(runs_dir: Path) -> None:
    table = build_table(TABLES["table1"], find_runs(runs_dir))
    diff = next(r for r in table.groups[0].rows if r.kind == "diff" and r.key == "table1_750m_kdn_diag")
    cell = diff.cells["wiki_ppl"]
    d = [DIAG_SEEDS[s][0] - KDA_SEEDS[s][0] for s in (0, 1)]  # seed 2 (KDA only) and 3 (Diagonal only) unpaired
    assert cell.seeds == [0, 1] and cell.values == pytest.approx(d)
    assert cell.text() == f"{sum(d) / 2:+.2f} ± {abs(d[0] - d[1]) / math.sqrt(2):.2f} (n=2)"
    assert diff.label == "Δ vs KDA"
    assert not any(r.kind == "diff" for r in build_table(TABLES["table1"], find_runs(runs_dir),
                                                          diffs=False).groups[0].rows)


def test_bold_goes_to_the_best_cell_per_column(runs_dir: Path) -> None:
    table = build_table(TABLES["table1"], find_runs(runs_dir))
    rows = {r.label: r for r in table.groups[0].rows if r.kind == "ours"}
    bold = {k: [label for label, r in rows.items() if r.cells[k] is not None and r.cells[k].bold]
            for k in ("wiki_ppl", "piqa")}
    assert bold == {"wiki_ppl": ["Isotropic KDN"], "piqa": ["Diagonal KDN"]}  # lowest perplexity, highest accuracy
    assert not any(c is not None and c.bold for r in table.groups[0].rows if r.kind == "diff" for c in r.cells.values())


def _md_cells(text: str) -> list[list[str]]:
    rows = [ln.strip().strip("|").split(" | ") for ln in text.splitlines() if ln.startswith("| ") and "*" != ln[2]]
    return [[c.strip() for c in r] for r in rows[1:]]


def _tex_cells(text: str) -> list[list[str]]:
    body = text.split(r"\toprule")[1].split(r"\bottomrule")[0]
    lines = [ln for ln in body.splitlines() if ln.endswith(r"\\") and r"\multicolumn" not in ln][1:]
    unescape = [(r"$\pm$", "±"), (r"$\Delta$", "Δ"), ("--", "—"), (r"\_", "_"), (r"\%", "%")]
    out = []
    for ln in lines:
        cells = [c.strip() for c in ln[:-2].split(" & ")]
        for a, b in unescape:
            cells = [c.replace(a, b) for c in cells]
        out.append(cells)
    return out


def _strip_bold(cells: list[list[str]], pattern: str) -> tuple[list[list[str]], set[tuple[int, int]]]:
    bold, plain = set(), []
    for i, row in enumerate(cells):
        new = []
        for j, c in enumerate(row):
            m = re.fullmatch(pattern, c)
            if m:
                bold.add((i, j))
                c = m.group(1)
            new.append(c)
        plain.append(new)
    return plain, bold


@pytest.mark.parametrize("tid", ["table1", "table2"])
def test_markdown_latex_and_csv_agree_cell_for_cell(runs_dir: Path, tid: str) -> None:
    table = build_table(TABLES[tid], find_runs(runs_dir), paper=True)
    md, md_bold = _strip_bold(_md_cells(markdown(table)), r"\*\*(.+)\*\*")
    tex, tex_bold = _strip_bold(_tex_cells(latex(table)), r"\\textbf\{(.+)\}")
    rows = list(csv.reader(io.StringIO(csv_text(table))))
    assert rows[0][3:] == [c.header for c in table.columns]
    flat = [[r[1], *r[3:]] for r in rows[1:]]
    assert md == tex == flat
    assert md_bold == tex_bold and md_bold
    assert len(flat) == sum(len(g.rows) for g in table.groups)
    assert any(r[2] == "paper" and r[1].endswith("(paper)") for r in rows[1:])


def test_paper_rows_carry_the_published_numbers(runs_dir: Path) -> None:
    table = build_table(TABLES["table4"], find_runs(runs_dir), paper=True)
    paper = {r.label: r for r in table.groups[0].rows if r.kind == "paper"}
    assert paper["mu = d_k (paper)"].cells["lmb_ppl"].mean == 14.15
    assert paper["mu = 4 d_k (paper)"].cells["avg"].mean == 54.92
    assert paper["mu = 1 (paper)"].cells["piqa"] is None
    assert not any(c is not None and c.bold for r in paper.values() for c in r.cells.values())


def test_missing_cells_name_the_run_or_preset(runs_dir: Path) -> None:
    runs = find_runs(runs_dir)
    t2 = build_table(TABLES["table2"], runs)
    diag = next(r for r in t2.groups[0].rows if r.label == "Diagonal KDN")
    assert diag.cells["mean"].n == 2  # seed 3 has no RULER results
    text = "\n".join(t2.missing)
    assert f"{runs_dir / 'diag_s3'} has no eval/ruler.json" in text
    assert "experiment=table2_750m_deltanet" in text and "experiment=table1_1.3b_kdn_diag" in text
    t1 = build_table(TABLES["table1"], runs)
    iso = next(r for r in t1.groups[0].rows if r.label == "Isotropic KDN")
    assert iso.cells["piqa"] is None and iso.cells["avg"] is None
    assert any("iso_s0: eval/lm.json has no piqa" in m for m in t1.missing)
    assert "—" in markdown(t1).split("Isotropic KDN |")[1].splitlines()[0]


def test_ruler_mean_is_over_all_fourteen_cells(tmp_path: Path) -> None:
    full = ruler_values(10.0)
    write_run(tmp_path, "a", ruler=full)
    write_run(tmp_path, "b", mixer="gdn2", ruler={c: 50.0 for c in RULER_CELLS[:-1]})
    t2 = build_table(TABLES["table2"], find_runs(tmp_path))
    rows = {r.label: r for r in t2.groups[0].rows}
    assert rows["KDA"].cells["mean"].mean == pytest.approx(sum(full.values()) / 14)
    assert rows["GDN-2"].cells["mean"] is None
    assert any("lacks niah_multikey_1@4096 for the mean" in m for m in t2.missing)


def test_table3_puts_recurrent_and_hybrid_side_by_side(tmp_path: Path) -> None:
    write_run(tmp_path, "rec", size="1.3b", retrieval={t: 30.0 + i for i, t in enumerate(RETRIEVAL_TASKS)})
    write_run(tmp_path, "hyb", size="1.3b", pattern="hybrid_swa", retrieval={t: 40.0 for t in RETRIEVAL_TASKS})
    t3 = build_table(TABLES["table3"], find_runs(tmp_path), paper=True)
    kda = t3.groups[0].rows[0]
    assert kda.cells["swde/recurrent"].mean == 30.0 and kda.cells["drop/recurrent"].mean == 35.0
    assert kda.cells["mean/recurrent"].mean == pytest.approx(32.5)
    assert kda.cells["mean/hybrid_swa"].mean == 40.0
    assert t3.groups[0].rows[1].cells["mean/hybrid_swa"].mean == 45.09  # KDA (paper)


def test_differing_evaluation_settings_are_refused(tmp_path: Path) -> None:
    write_run(tmp_path, "a", ruler=ruler_values(40.0))
    write_run(tmp_path, "b", mixer="gdn2", ruler=ruler_values(40.0), ruler_settings={"samples_per_cell": 500})
    runs = find_runs(tmp_path)
    with pytest.raises(SettingsMismatch, match=r"settings\.samples_per_cell: 20 \(.*a\); 500 \(.*b\)"):
        build_table(TABLES["table2"], runs)
    build_table(TABLES["table1"], runs)  # Table 1 reads no RULER results
    write_run(tmp_path, "c", mixer="deltanet", ruler=ruler_values(1.0),
              ruler_settings={"samples_per_cell": 500, "haystack": {"source": "other.txt", "sha256": "ef56"}})
    (tmp_path / "a").rename(tmp_path.parent / "a_moved")
    with pytest.raises(SettingsMismatch, match="haystack.sha256"):
        build_table(TABLES["table2"], find_runs(tmp_path))


def test_data_seed_duplicates_and_bad_files_are_errors(tmp_path: Path) -> None:
    write_run(tmp_path, "a", lm=lm_values(18.0, 50.0))
    write_run(tmp_path, "b", mixer="kdn_iso", lm=lm_values(18.0, 50.0), data_seed=1)
    with pytest.raises(SettingsMismatch, match="data.seed"):
        build_table(TABLES["table1"], find_runs(tmp_path))
    write_run(tmp_path / "dup", "a", lm=lm_values(18.0, 50.0))
    write_run(tmp_path / "dup", "a_copy", lm=lm_values(18.1, 50.0))
    with pytest.raises(ValueError, match="both 750m/recurrent/kda with seed 0"):
        build_table(TABLES["table1"], find_runs(tmp_path / "dup"))
    bad = write_run(tmp_path / "bad", "x", lm=lm_values(18.0, 50.0))
    (bad / "eval" / "lm.json").write_text(json.dumps({"schema": 0, "suite": "lm"}))
    with pytest.warns(UserWarning, match="schema 0, expected 1"):  # left out, the run kept
        (run,) = find_runs(tmp_path / "bad")
    assert run.results == {}
    (bad / "metrics.jsonl").write_text('{"step": 1\n{"step": 2, "loss": 1.0}\n')
    (bad / "eval" / "lm.json").unlink()
    with pytest.warns(UserWarning, match="metrics.jsonl:1 is not JSON"):
        (run,) = find_runs(tmp_path / "bad")
    assert run.train == []
    with pytest.raises(ValueError, match="is not a directory"):
        find_runs(tmp_path / "nowhere")


def test_identity_of_a_composed_training_config(tmp_path: Path) -> None:
    from hydra import compose, initialize_config_dir

    from eval.tables.runs import CONF_DIR, preset_identity

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = compose("config", overrides=["experiment=table4_mu_sqrt", "seed=3"])
    run = tmp_path / "table4_mu_sqrt"
    run.mkdir()
    (run / "config.yaml").write_text(OmegaConf.to_yaml(cfg))
    (found,) = find_runs(tmp_path)
    assert found.experiment == preset_identity("table4_mu_sqrt") and found.seed == 3 and found.data_seed == 0
    assert found.experiment != preset_identity("table4_mu_dk")
    assert preset_identity("table4_mu_dk") == preset_identity("table1_750m_kdn_diag")  # one experiment, two tables
    full = write_run(tmp_path / "attn", "full", size="1.3b", mixer="attn", lm=lm_values(17.0, 50.0))
    cfg = OmegaConf.load(full / "config.yaml")
    cfg.mixer.kwargs = {"window": None}  # recorded when attention kept its own window: full causal attention
    OmegaConf.save(cfg, full / "config.yaml")
    (run,) = find_runs(tmp_path / "attn")
    assert run.experiment.kwargs == (("window", "None"),)
    assert run.experiment != preset_identity("table1_1.3b_transformer_swa")


def test_hydra_copies_and_results_without_config_are_handled(tmp_path: Path) -> None:
    run = write_run(tmp_path, "a", lm=lm_values(18.0, 50.0))
    (run / ".hydra").mkdir()
    (run / ".hydra" / "config.yaml").write_text("name: a\n")
    (run / "config.yaml").unlink()  # identity from the results' model block
    runs = find_runs(tmp_path)
    assert [r.name for r in runs] == ["a"] and runs[0].experiment.mixer == "kda"
    b = write_run(tmp_path / "exp", "b", mixer="kdn_diag", ruler=ruler_values(50.0))
    (b / "hf" / "eval").mkdir(parents=True)
    (b / "eval" / "ruler.json").rename(b / "hf" / "eval" / "ruler.json")  # evaluated through its export
    runs = find_runs(tmp_path / "exp")
    assert [r.name for r in runs] == ["b"] and runs[0].experiment.mixer == "kdn_diag" and "ruler" in runs[0].results


def test_figures_are_written_and_non_empty(runs_dir: Path, tmp_path: Path) -> None:
    bench = tmp_path / "tp.json"
    rows = [{"mixer": m, "T": t, "tokens_per_s": 1e6 * (1 + i) / (1 + t / 8192)}
            for i, m in enumerate(("kdn_diag", "kda")) for t in (2048, 4096, 8192)]
    rows.append({"mixer": "gdn", "T": 2048, "tokens_per_s": None, "error": "RuntimeError: kernels missing"})
    bench.write_text(json.dumps({"header": {"device": "test", "batch": 4, "d_model": 64}, "results": rows}))
    with pytest.warns(UserWarning, match="gdn at T=2048: RuntimeError: kernels missing"):
        paths = throughput_figure(bench, tmp_path / "figs")
    assert sorted(p.suffix for p in paths) == [".pdf", ".png"]
    assert all(p.stat().st_size > 1000 for p in paths)
    curves = loss_curves(find_runs(runs_dir), tmp_path / "figs" / "loss.png")
    assert curves is not None and curves.stat().st_size > 1000
    assert loss_curves([], tmp_path / "none.png") is None


def test_cli_writes_every_table_and_lists_missing_cells(runs_dir: Path, tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(runs_dir), "--paper", "--out", str(out)]) == 0
    assert "table5: 3 missing cell(s)" in capsys.readouterr().err
    for tid in TABLES:
        for ext in ("md", "tex", "csv", "json"):
            assert (out / f"{tid}.{ext}").stat().st_size > 0
    assert (out / "loss_curves.png").stat().st_size > 1000
    assert "experiment=table4_mu_sqrt" in (out / "missing.txt").read_text()
    assert "diag_s3" in (out / "runs.md").read_text()
    data = json.loads((out / "table1.json").read_text())
    assert data["groups"][0]["rows"][0]["cells"]["wiki_ppl"]["seeds"] == [0, 1, 2]
    with pytest.raises(SystemExit):
        main(["--out", str(out)])
    with pytest.raises(SystemExit):
        main([str(runs_dir), "--tables", "table9", "--out", str(out)])
