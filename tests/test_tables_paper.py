"""eval.tables beside the paper: our Table 1 / 2 / 3 rows sit beside the published ones only when they followed the
paper's protocol (full lm-eval sets, zero-shot; RULER's 500 samples a cell and 128 new tokens on the essays identified
by content; the JRT truncation at the paper's context, 48 new tokens, every document, the current task definitions),
are marked and kept apart in every format otherwise, one off-protocol setting being enough; and each field of the
comparability check refuses a mismatch on its own."""
from __future__ import annotations

import csv
import io
import json
import re
from pathlib import Path
from typing import Any

import pytest
from omegaconf import OmegaConf
from test_tables import lm_values, ruler_values, write_run

from eval.tables import TABLES, SettingsMismatch, Table, build_table, csv_text, find_runs, latex, markdown
from eval.tables.paper import PAPER_CONTEXT_TOKENS, PAPER_SETTINGS, PAPER_TRUNCATION
from eval.tables.specs import RETRIEVAL_TASKS
from eval.tasks import VERSIONS

KJV = {"name": "kjv", "source": "kjv", "sha256": "cd34", "paper": False}
OLD_ESSAYS = {"source": "PaulGrahamEssays.json", "sha256": "9f1e"}  # an older file: no name, no paper flag
# an older record of a file called the paper's by its name alone: no check
NAMED_ESSAYS = {"name": "essays", "source": "/data/PaulGrahamEssays.json", "sha256": "9f1e", "paper": True}
ESSAYS = {"name": "essays", "source": "hub:baber/paul_graham_essays", "file": None, "bytes": 2_900_000,
          "sha256": "9f1e", "documents": 215, "paper": True,
          "check": "the hub dataset baber/paul_graham_essays, which lm-eval's RULER port reads (identified by its "
                   "name)"}
PAPER_RULER = {**PAPER_SETTINGS["ruler"], "haystack": ESSAYS}
PAPER_RETRIEVAL = {**PAPER_SETTINGS["retrieval"], "tasks": dict(VERSIONS)}
LM_MARK = "not the paper's lm-eval settings"
RULER_MARK = "not the paper's RULER settings"
RETRIEVAL_MARK = "not the paper's retrieval settings"
APART = "The paper's published numbers"


def ruler_runs(root: Path, settings: dict[str, Any], drop: str | None = None) -> list:
    """750M KDA (seeds 0, 1) and Diagonal KDN (seed 0) with every RULER cell, evaluated with ``settings``; ``drop``:
    a settings key left out."""
    for name, mixer, seed, base in (("kda_s0", "kda", 0, 40.0), ("kda_s1", "kda", 1, 42.0),
                                    ("diag_s0", "kdn_diag", 0, 60.0)):
        run = write_run(root, name, mixer=mixer, seed=seed, ruler=ruler_values(base), ruler_settings=settings)
        if drop is not None:
            path = run / "eval" / "ruler.json"
            body = json.loads(path.read_text())
            del body["settings"][drop]
            path.write_text(json.dumps(body))
    return find_runs(root)


def lm_runs(root: Path, change: dict[str, Any] | str | None) -> list:
    """750M KDA and Diagonal KDN with Table 1's values, at the paper's lm settings but for ``change`` (a dict of
    values, or the name of a setting left unrecorded)."""
    for name, mixer, wiki in (("kda", "kda", 18.9), ("diag", "kdn_diag", 18.6)):
        run = write_run(root, name, mixer=mixer, lm=lm_values(wiki, 50.0))
        path = run / "eval" / "lm.json"
        body = json.loads(path.read_text())
        if isinstance(change, dict):
            body["settings"].update(change)
        elif change is not None:
            del body["settings"][change]
        path.write_text(json.dumps(body))
    return find_runs(root)


def retrieval_runs(root: Path, settings: dict[str, Any], drop: str | None = None) -> list:
    """1.3B KDA and Diagonal KDN, recurrent and hybrid, with all six tasks; ``drop``: a settings key left out."""
    for mixer in ("kda", "kdn_diag"):
        for pattern in ("recurrent", "hybrid_swa"):
            run = write_run(root, f"{mixer}_{pattern}", size="1.3b", mixer=mixer, pattern=pattern,
                            retrieval={t: 30.0 + i for i, t in enumerate(RETRIEVAL_TASKS)},
                            retrieval_settings=settings)
            if drop is not None:
                path = run / "eval" / "retrieval.json"
                body = json.loads(path.read_text())
                del body["settings"][drop]
                path.write_text(json.dumps(body))
    return find_runs(root)


def kinds_by_group(table: Table) -> list[tuple[str, set[str]]]:
    return [(g.label, {r.kind for r in g.rows}) for g in table.groups]


def assert_kept_apart(table: Table, mark: str) -> None:
    """Our rows with a value are marked; no group mixes ours with the paper's; the paper's groups come last."""
    groups = kinds_by_group(table)
    ours = [i for i, (_, k) in enumerate(groups) if k & {"ours", "diff"}]
    paper = [i for i, (_, k) in enumerate(groups) if "paper" in k]
    assert paper and ours and max(ours) < min(paper)
    assert all(k == {"paper"} and label.startswith(APART) for label, k in groups[min(paper):])
    filled = [r for g in table.groups for r in g.rows if r.kind == "ours" and any(r.cells.values())]
    assert filled and all(r.note == mark for r in filled)
    md = markdown(table)
    assert md.index(APART) > max(md.index(f"| {r.label} ({mark}) |") for r in filled)
    tex = latex(table)
    assert tex.index(APART) > max(tex.index(f"{r.label} ({mark}) &") for r in filled)
    rows = list(csv.reader(io.StringIO(csv_text(table))))[1:]
    assert {(r[1], r[2]) for r in rows if r[1].endswith(f"({mark})")} == {(f"{r.label} ({mark})", "ours")
                                                                        for r in filled}
    assert all(r[0].startswith(APART) for r in rows if r[2] == "paper")
    assert all(not r.kind == "paper" or not any(c.bold for c in r.cells.values() if c is not None)
               for g in table.groups for r in g.rows)


def assert_placed(table: Table) -> None:
    """Each of our rows is followed, within its group, by the paper's row of the same model; nothing is marked."""
    assert not table.notes and not any(g.label.startswith(APART) for g in table.groups)
    for g in table.groups:
        labels = [r.label for r in g.rows if r.kind != "diff"]
        for r in g.rows:
            assert not r.note
            if r.kind == "paper":
                assert labels[labels.index(r.label) - 1] == r.label.removesuffix(" (paper)")
    md = markdown(table)
    assert "| Diagonal KDN |" in md and "not the paper's" not in md and APART not in md


@pytest.mark.parametrize("haystack", [KJV, {"source": "kjv", "sha256": "cd34"}, OLD_ESSAYS, NAMED_ESSAYS],
                         ids=["kjv", "kjv_older_file", "essays_older_file", "essays_by_name_only"])
def test_table2_off_the_essays_is_marked_and_kept_apart_in_every_format(tmp_path: Path,
                                                                        haystack: dict[str, Any]) -> None:
    table = build_table(TABLES["table2"], ruler_runs(tmp_path, {**PAPER_RULER, "haystack": haystack}), paper=True)
    assert_kept_apart(table, RULER_MARK)
    assert any(f"RULER ran on {haystack.get('name') or haystack['source']}" in n for n in table.notes)
    assert "RULER ran on" in markdown(table).split("\n\n")[-1]  # the caption says why
    plain = build_table(TABLES["table2"], find_runs(tmp_path))  # without --paper the rows still say it
    assert all(r.note == RULER_MARK for r in plain.groups[0].rows if r.kind == "ours" and any(r.cells.values()))


@pytest.mark.parametrize("change", [{"samples_per_cell": 4}, {"max_new_tokens": 32}, {"seed": 1},
                                    {"cells": ["niah_single_1@1024", "niah_single_2@1024"]}, "samples_per_cell",
                                    "max_new_tokens", "seed", "cells"],
                         ids=["samples", "new_tokens", "seed", "cells", "samples_unrecorded", "new_tokens_unrecorded",
                              "seed_unrecorded", "cells_unrecorded"])
def test_table2_off_the_papers_samples_seed_cells_or_new_tokens_is_kept_apart(tmp_path: Path, change: Any) -> None:
    """On the essays, a run of the quick preset's 4 samples a cell, another seed, a part of the paper's grid or 32 new
    tokens is not the paper's protocol."""
    settings = {**PAPER_RULER, **change} if isinstance(change, dict) else PAPER_RULER
    table = build_table(TABLES["table2"], ruler_runs(tmp_path, settings, drop=None if isinstance(change, dict) else
                                                     change), paper=True)
    assert_kept_apart(table, RULER_MARK)
    key = change if isinstance(change, str) else next(iter(change))
    assert any(key in n and "RULER ran on" not in n for n in table.notes), table.notes


def test_table2_with_the_paper_protocol_is_placed_beside_the_paper(tmp_path: Path) -> None:
    table = build_table(TABLES["table2"], ruler_runs(tmp_path, PAPER_RULER), paper=True)
    assert_placed(table)
    rows = [(r.label, r.kind) for r in table.groups[0].rows]
    i = rows.index(("Diagonal KDN", "ours"))
    assert rows[i + 1:i + 3] == [("Δ vs KDA", "diff"), ("Diagonal KDN (paper)", "paper")]


@pytest.mark.parametrize("change", [{"truncation": "answer_window"}, {"context_tokens": PAPER_CONTEXT_TOKENS + 48},
                                    {"limit": 50}, {"max_new_tokens": 32}, {"tasks": {**VERSIONS, "swde": 1.0}},
                                    "truncation", "context_tokens", "limit", "max_new_tokens", "tasks"],
                         ids=["truncation", "context_tokens", "limit", "new_tokens", "older_swde",
                              "truncation_unrecorded", "context_unrecorded", "limit_unrecorded",
                              "new_tokens_unrecorded", "versions_unrecorded"])
def test_table3_off_the_paper_protocol_is_marked_and_kept_apart(tmp_path: Path, change: Any) -> None:
    runs = retrieval_runs(tmp_path, {**PAPER_RETRIEVAL, **change} if isinstance(change, dict) else PAPER_RETRIEVAL,
                          drop=change if isinstance(change, str) else None)
    table = build_table(TABLES["table3"], runs, paper=True)
    assert_kept_apart(table, RETRIEVAL_MARK)
    key = change if isinstance(change, str) else next(iter(change))
    want = {"tasks": "swde at definition version 1.0 (the current one: 2.0)"}.get(key, key) \
        if isinstance(change, dict) else {"tasks": "task definition versions unrecorded"}.get(key, key)
    assert any(want in n for n in table.notes), table.notes


def test_table3_with_the_paper_protocol_is_placed(tmp_path: Path) -> None:
    assert PAPER_RETRIEVAL["truncation"] == PAPER_TRUNCATION and PAPER_RETRIEVAL["limit"] is None
    assert_placed(build_table(TABLES["table3"], retrieval_runs(tmp_path, PAPER_RETRIEVAL), paper=True))


@pytest.mark.parametrize("change", [{"limit": 50}, {"num_fewshot": 5}, "limit", "num_fewshot"],
                         ids=["limit", "few_shot", "limit_unrecorded", "few_shot_unrecorded"])
def test_table1_off_the_full_zero_shot_sets_is_kept_apart(tmp_path: Path, change: Any) -> None:
    table = build_table(TABLES["table1"], lm_runs(tmp_path, change), paper=True)
    assert_kept_apart(table, LM_MARK)
    key = change if isinstance(change, str) else next(iter(change))
    assert any(key in n for n in table.notes), table.notes


def test_table1_with_the_paper_protocol_is_placed(tmp_path: Path) -> None:
    assert_placed(build_table(TABLES["table1"], lm_runs(tmp_path, None), paper=True))


# Every field of the comparability check, by suite; each alone must refuse a table that mixes two values of it.
SUITE_TABLE = {"lm": "table1", "ruler": "table2", "retrieval": "table3"}
FIELDS = [("lm", "max_length", 2048), ("lm", "limit", 50), ("lm", "num_fewshot", 5), ("lm", "tokenizer_sha256", "ff"),
          ("ruler", "samples_per_cell", 20), ("ruler", "seed", 7), ("ruler", "haystack.sha256", "ef56"),
          ("ruler", "tokenizer_sha256", "ff"), ("ruler", "max_new_tokens", 64),
          ("retrieval", "truncation", "answer_window"), ("retrieval", "context_tokens", 4096),
          ("retrieval", "limit", 50), ("retrieval", "max_new_tokens", 64), ("retrieval", "tokenizer_sha256", "ff")]


def comparable_pair(root: Path) -> list[Path]:
    """Two runs (KDA and Diagonal KDN, 1.3B recurrent) with every suite, agreeing on every setting."""
    return [write_run(root, name, size="1.3b", mixer=mixer, lm=lm_values(16.0, 50.0), ruler=ruler_values(50.0),
                      retrieval={t: 30.0 for t in RETRIEVAL_TASKS}, ruler_settings=PAPER_RULER)
            for name, mixer in (("kda", "kda"), ("diag", "kdn_diag"))]


def set_setting(run: Path, suite: str, key: str, value: Any) -> None:
    path = run / "eval" / f"{suite}.json"
    body = json.loads(path.read_text())
    *parents, last = key.split(".")
    node = body["settings"]
    for p in parents:
        node = node.setdefault(p, {})
    node[last] = value
    path.write_text(json.dumps(body))


@pytest.mark.parametrize(("suite", "key", "value"), FIELDS, ids=[f"{s}.{k}" for s, k, _ in FIELDS])
def test_each_setting_alone_refuses_a_mixed_table(tmp_path: Path, suite: str, key: str, value: Any) -> None:
    _, diag = comparable_pair(tmp_path)
    for tid in SUITE_TABLE.values():
        build_table(TABLES[tid], find_runs(tmp_path))  # agreeing runs tabulate
    set_setting(diag, suite, key, value)
    runs = find_runs(tmp_path)
    with pytest.raises(SettingsMismatch, match=rf"{SUITE_TABLE[suite]} mixes {suite} results with different "
                                               rf"settings\.{key}: .*{re.escape(repr(value))} \(\S*diag\)"):
        build_table(TABLES[SUITE_TABLE[suite]], runs)
    for other in set(SUITE_TABLE.values()) - {SUITE_TABLE[suite]}:
        build_table(TABLES[other], runs)  # the tables that read other suites are unaffected


def test_data_seed_alone_refuses_and_absent_or_meaningless_keys_agree(tmp_path: Path) -> None:
    kda, diag = comparable_pair(tmp_path)
    set_setting(kda, "ruler", "max_length", 128)  # lm-eval's value, unused by RULER's own prompts
    set_setting(diag, "ruler", "lengths", [1024, 2048])  # recorded by one file only: not a number-changing key
    build_table(TABLES["table2"], find_runs(tmp_path))
    cfg = OmegaConf.load(diag / "config.yaml")
    cfg.data.seed = 1
    OmegaConf.save(cfg, diag / "config.yaml")
    with pytest.raises(SettingsMismatch, match="data.seed"):
        build_table(TABLES["table1"], find_runs(tmp_path))
