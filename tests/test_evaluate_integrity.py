"""evaluate.py reports only the numbers of the weights it names: every results file carries the identity of the
weights its cells were computed on, and cells of other weights are recomputed, never reused or mixed (nor by
eval.tables); a checkpoint is verified against its manifest as a resume verifies it, and a damaged one, a planted
pickle or a stale export is refused or replaced; override typos and unknown ``+`` keys are refused in one line."""
from __future__ import annotations

import json
import logging
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from eval_fixtures import export_toy_run, verse_shards
from test_evaluate_export import logits_rel_err

import eval.perplexity
import evaluate
from eval.harness import load_model
from eval.model_dir import EXPORT_MANIFEST, Target, resolve, weights_identity
from eval.suites import Context, run_cells
from trainer.checkpoint import MANIFEST, CheckpointError, load_pickle, write_manifest

CELLS = ["niah_single_1@1024", "niah_single_1@2048", "niah_single_2@1024", "niah_single_2@2048"]


class _Planted:
    """A pickle that calls a global when loaded without the weights-only guard (here a harmless ``print``)."""

    def __reduce__(self) -> tuple:
        return (print, ("planted pickle ran",))


def write_checkpoint(run: Path, step: int, scale: float) -> tuple[Path, torch.nn.Module]:
    """``run/checkpoints/step_<step>`` as training leaves it (full weights, train state, manifest written last),
    holding the run's exported weights times ``scale``; returns it and that model."""
    model, _ = load_model(run / "hf", device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    ckpt = run / "checkpoints" / f"step_{step:09d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), ckpt / "pytorch_model.bin")
    (ckpt / "train_state.json").write_text(json.dumps({"step": step}))
    write_manifest(ckpt)
    return ckpt, model


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    at = len(data) // 2
    data[at:at + 16] = bytes(b ^ 0xFF for b in data[at:at + 16])
    path.write_bytes(bytes(data))


def _ctx(out: Path, sha: str) -> Context:
    return Context(target=Target(out, None, out), model=None, hf_tokenizer=None, tokenizer=None,
                   device=torch.device("cpu"), dtype="float32", max_length=64, attention_limit=None,
                   model_meta={"name": "toy"}, weights={"sha256": sha, "files": {}}, progress=False)


def _run(ctx: Context, cells: list[str], computed: list[str], base: float) -> dict[str, Any]:
    def run_cell(cell: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        computed.append(cell)
        return {"score": base + CELLS.index(cell)}, []

    def summarize(res: dict[str, Any]) -> dict[str, Any]:
        return {"mean": sum(r["score"] for r in res.values()) / len(res), "cells": len(res)}

    return run_cells(ctx, "ruler", {"samples_per_cell": 3, "seed": 0}, cells, run_cell, summarize)


def test_cells_of_other_weights_are_recomputed_and_never_mixed_into_the_file(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    old, new = "a1" * 32, "b2" * 32
    computed: list[str] = []
    _run(_ctx(tmp_path, old), CELLS, computed, base=10.0)
    assert json.loads((tmp_path / "ruler.json").read_text())["weights"]["sha256"] == old
    computed.clear()
    with caplog.at_level(logging.INFO, logger="evaluate"):
        rep = _run(_ctx(tmp_path, new), CELLS[:2], computed, base=50.0)  # the continued run, two cells asked for
    assert computed == CELLS[:2]  # recomputed on the new weights, not reused
    lines = [r.getMessage() for r in caplog.records if "other weights" in r.getMessage()]
    assert len(lines) == 1 and f"the 4 cells of {tmp_path / 'ruler.json'}" in lines[0] and old[:12] in lines[0]
    on_disk = json.loads((tmp_path / "ruler.json").read_text())
    assert on_disk == rep and on_disk["weights"]["sha256"] == new
    assert on_disk["results"] == {CELLS[0]: {"score": 50.0}, CELLS[1]: {"score": 51.0}}  # the old cells are gone
    assert on_disk["summary"] == {"mean": 50.5, "cells": 2}
    computed.clear()
    _run(_ctx(tmp_path, new), CELLS[:2], computed, base=90.0)
    assert computed == []  # cells of the same weights are reused


def test_a_results_file_without_weights_is_recomputed(tmp_path: Path) -> None:
    (tmp_path / "ruler.json").write_text(json.dumps({"settings": {"samples_per_cell": 3, "seed": 0},
                                                     "results": {CELLS[0]: {"score": 7.0}}}))
    computed: list[str] = []
    rep = _run(_ctx(tmp_path, "c3" * 32), CELLS[:1], computed, base=20.0)
    assert computed == CELLS[:1] and rep["results"] == {CELLS[0]: {"score": 20.0}}


def test_a_continued_runs_export_is_evaluated_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    shards = verse_shards(tmp_path, 40)
    calls: list[str] = []
    real = eval.perplexity.shard_perplexity

    def counted(model: Any, *args: Any, **kwargs: Any) -> dict[str, float]:
        calls.append(kwargs["split"])
        return real(model, *args, **kwargs)

    monkeypatch.setattr(eval.perplexity, "shard_perplexity", counted)
    args = [f"model={run}", "suites=[ppl]", f"ppl.shards={shards}", "ppl.seq_len=16", "progress=false"]
    first = evaluate.run(evaluate.compose(args))["reports"]["ppl"]
    assert first["weights"] == weights_identity(run / "hf") and len(first["weights"]["sha256"]) == 64
    assert set(first["weights"]["files"]) == {"config.json", "model.safetensors"}
    evaluate.run(evaluate.compose(args))
    assert calls == ["val"]  # the same weights: reused
    model, _ = load_model(run / "hf", device="cpu")  # training continued: the export is replaced
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    model.save_pretrained(run / "hf")
    with caplog.at_level(logging.WARNING, logger="evaluate"):
        second = evaluate.run(evaluate.compose(args))["reports"]["ppl"]
    assert calls == ["val", "val"] and "computed on other weights" in caplog.text
    assert second["weights"]["sha256"] != first["weights"]["sha256"]
    assert second["results"]["val"]["loss"] != first["results"]["val"]["loss"]
    assert json.loads((run / "eval" / "ppl.json").read_text()) == second


def test_an_export_replaced_while_it_is_loaded_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    real = evaluate.load_model

    def replaced_meanwhile(hf_dir: Path, **kwargs: Any) -> Any:
        out = real(hf_dir, **kwargs)
        out[0].save_pretrained(tmp_path / "new")  # a training run exports again while the model loads
        (tmp_path / "new" / "model.safetensors").replace(Path(hf_dir) / "model.safetensors")
        return out

    monkeypatch.setattr(evaluate, "load_model", replaced_meanwhile)
    with pytest.raises(ValueError, match=rf"^{run / 'hf'} changed while it was hashed and loaded"):
        evaluate.build_context(evaluate.compose([f"model={run}", "suites=[ppl]"]))


def test_a_damaged_checkpoint_is_refused_and_its_export_is_not_reused(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    ckpt, model = write_checkpoint(run, 12, 1.5)
    target = resolve(ckpt)  # intact: verified, exported
    assert logits_rel_err(target.hf_dir, model) < 1e-6
    weights = ckpt / "pytorch_model.bin"
    _flip(weights)
    with pytest.raises(CheckpointError) as err:
        resolve(ckpt)
    assert str(err.value) == (f"checkpoint {ckpt} is damaged: {weights} fails its SHA-256 checksum; evaluate "
                              f"another checkpoint, or restore this one from a copy (a resume of the run sets it "
                              f"aside as {ckpt.name}.corrupt)")
    with pytest.raises(CheckpointError, match="fails its SHA-256 checksum"):
        evaluate.run(evaluate.compose([f"model={ckpt}", "suites=[ppl]", "ppl.shards=x"]))
    (ckpt / MANIFEST).unlink()  # a save that never finished
    with pytest.raises(CheckpointError, match=rf"^{ckpt} has no {MANIFEST}: it is not a complete checkpoint"):
        resolve(ckpt)


def test_a_rewritten_checkpoint_is_exported_again(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    ckpt, _ = write_checkpoint(run, 12, 1.5)
    first = json.loads((resolve(ckpt).hf_dir / EXPORT_MANIFEST).read_text())
    assert first["manifest_sha256"] and all(len(e["sha256"]) == 64 for e in first["files"].values())
    _, model = write_checkpoint(run, 12, 0.5)  # the step saved again (a restarted run), with other weights
    target = resolve(ckpt)
    assert logits_rel_err(target.hf_dir, model) < 1e-6  # the stale export was replaced, not loaded
    assert json.loads((target.hf_dir / EXPORT_MANIFEST).read_text())["manifest_sha256"] != first["manifest_sha256"]


def test_a_planted_pickle_is_refused_in_the_words_of_a_resume(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    ckpt, _ = write_checkpoint(run, 12, 1.5)
    weights = ckpt / "pytorch_model.bin"
    torch.save({"state": _Planted()}, weights)
    write_manifest(ckpt)  # re-signed: only the load can tell
    with pytest.raises(CheckpointError) as ref:
        load_pickle(weights)  # the line a resume gives for this file
    assert "weights_only=False" not in str(ref.value) and str(weights) in str(ref.value)
    with pytest.raises(CheckpointError) as err:
        evaluate.run(evaluate.compose([f"model={ckpt}", "suites=[ppl]", "ppl.shards=x"]))
    assert str(err.value).startswith(f"checkpoint {ckpt} is damaged: {ref.value}; ")
    assert not (ckpt / "hf").exists()
    bare = tmp_path / "bare"  # a Hugging Face export whose weights file is a pickle
    load_model(run / "hf", device="cpu")[0].save_pretrained(bare, safe_serialization=False)
    torch.save({"state": _Planted()}, bare / "pytorch_model.bin")
    with pytest.raises(CheckpointError) as err:
        evaluate.run(evaluate.compose([f"model={bare}", "suites=[ppl]", "ppl.shards=x"]))
    assert str(err.value) == str(ref.value).replace(str(weights), str(bare / "pytorch_model.bin"))


def test_override_typos_and_unknown_plus_keys_are_refused_in_one_line(monkeypatch: pytest.MonkeyPatch,
                                                                      capsys: pytest.CaptureFixture) -> None:
    evaluate.check_override_keys(["-m", "model=runs/a,runs/b", "preset=quick", "hydra/launcher=slurm",
                                  "hydra.run.dir=x", "ruler.samples_per_cell=2", "~expected", "++ruler.seed=1",
                                  "lm.tasks=[piqa]", "--cfg", "job"])
    for arg, msg in (("ruler.sample_per_cell=2", "ruler.sample_per_cell: unknown key (did you mean "
                                                 "'samples_per_cell'?)"),
                     ("+ruler.sample_per_cell=2", "ruler.sample_per_cell: unknown key (did you mean "
                                                  "'samples_per_cell'?)"),
                     ("++rulr.seed=1", "rulr: unknown key (did you mean 'ruler'?)"),
                     ("+zzz=1", "zzz: unknown key (valid keys: ")):
        for args in (["model=x", arg], [arg, "model=x"]):  # the first argument is checked as the others are
            with pytest.raises(ValueError) as e:
                evaluate.check_override_keys(args)
            assert str(e.value).startswith(msg), str(e.value)
    with pytest.raises(ValueError, match="did you mean 'samples_per_cell'"):
        evaluate.compose(["model=x", "+ruler.sample_per_cell=2"])  # Hydra itself would accept and ignore it
    monkeypatch.setattr(sys, "argv", ["evaluate.py", "model=x", "+ruler.sample_per_cell=2"])
    with pytest.raises(SystemExit) as stop:
        evaluate.main()
    assert stop.value.code == 2
    assert capsys.readouterr().err == ("evaluate: ruler.sample_per_cell: unknown key (did you mean "
                                       "'samples_per_cell'?)\n")


def test_tables_never_join_suites_computed_on_other_weights(tmp_path: Path) -> None:
    from test_tables import write_run

    from eval.tables.runs import load_run

    run = write_run(tmp_path, "r", lm={"wiki_ppl": 18.0}, ruler={"niah_single_1@1024": 40.0},
                    retrieval={"swde": 30.0})
    for suite, sha, date in (("lm", "a1", "2026-12-01T10:00:00Z"), ("ruler", "b2", "2026-12-02T10:00:00Z"),
                             ("retrieval", "b2", "2026-12-02T09:00:00Z")):
        path = run / "eval" / f"{suite}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "weights": {"sha256": sha * 32}, "date": date}))
    skipped: list[str] = []
    loaded = load_run(run, skipped)
    assert loaded is not None and sorted(loaded.results) == ["retrieval", "ruler"]
    assert skipped == [f"skipped {run / 'eval' / 'lm.json'}: computed on other weights (sha256 {'a1' * 6}) than "
                       f"the newest results of {run} (ruler.json, sha256 {'b2' * 6}); rerun evaluate.py "
                       f"suites=[lm] on it"]


def test_a_cell_of_an_earlier_task_definition_is_computed_again(tmp_path: Path,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    from eval.results import load_previous

    weights = {"sha256": "ab" * 32}
    old = {"settings": {"context_tokens": 2048, "tasks": {"swde": 1.0, "squad": 1.0}}, "weights": weights,
           "results": {"swde": {"score": 41.0, "n": 3}, "squad": {"score": 12.5, "n": 3}}}
    path = tmp_path / "retrieval.json"
    path.write_text(json.dumps(old))
    new = {"context_tokens": 2048, "tasks": {"swde": 2.0, "squad": 1.0}}
    with caplog.at_level(logging.INFO, logger="evaluate"):
        kept = load_previous(path, new, overwrite=False, weights=weights)
    assert kept == {"squad": {"score": 12.5, "n": 3}}, "SWDE's cell of definition 1.0 must not be reused at 2.0"
    assert "recomputing swde" in caplog.text and "1.0 -> 2.0" in caplog.text
    same = {"context_tokens": 2048, "tasks": {"swde": 1.0, "squad": 1.0}}
    assert load_previous(path, same, overwrite=False, weights=weights) == old["results"]


def test_a_truncated_weights_file_is_refused_in_one_line(tmp_path: Path) -> None:
    import models
    from eval.harness import load_model

    models.build_model(models.model_config("toy", "kdn_diag")).save_pretrained(tmp_path / "hf")
    weights = tmp_path / "hf" / "model.safetensors"
    with weights.open("r+b") as f:  # a copy or a write cut short
        f.truncate(weights.stat().st_size // 2)
    with pytest.raises(ValueError) as refusal:
        load_model(tmp_path / "hf")
    line = str(refusal.value)
    assert "\n" not in line and line.startswith(f"{tmp_path / 'hf'}: the weights cannot be read (")
    assert line.endswith("the file is damaged or truncated: export the model again (rerun its train.py command) or "
                         "copy it anew")
