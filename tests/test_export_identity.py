"""A run's export is the weights it claims to be: train.py exports again when its newest checkpoint is newer than
the export (an export that was interrupted or met a full disk), evaluate.py refuses an export older than the run's
newest checkpoint or one that fails its export.json, and results label the weights with their own step and tokens
(a checkpoint's train state, an export's record), never the run's latest record."""
from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
import torch
from eval_fixtures import export_toy_run, verse_shards
from test_evaluate_export import logits_rel_err
from test_evaluate_integrity import _flip, write_checkpoint
from toy_run import TOY, run_train

import evaluate
import train
from eval.harness import load_model
from eval.model_dir import model_metadata, resolve
from trainer.checkpoint import EXPORT_MANIFEST, CheckpointError, write_manifest

TOKENS_PER_STEP = 256  # TOY: trainer.global_batch_tokens


def _step_model(run: Path, step: int) -> torch.nn.Module:
    """The run's model holding the weights of checkpoint ``step``."""
    model, _ = load_model(run / "hf", device="cpu")
    state = torch.load(run / "checkpoints" / f"step_{step:09d}" / "pytorch_model.bin", map_location="cpu")
    model.load_state_dict(state)
    return model.eval()


def test_a_continued_run_whose_export_failed_exports_again_and_is_not_evaluated_meanwhile(
        tmp_path: Path, shards: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "r"
    common = TOY + shards + [f"run_dir={run}", "trainer.export=true", "trainer.ckpt_every=0"]
    run_train(common + ["trainer.max_steps=4"])
    assert json.loads((run / "hf" / EXPORT_MANIFEST).read_text())["step"] == 4
    assert resolve(run).trained == (4, 4 * TOKENS_PER_STEP)
    real = train.export_hf

    def full_disk(accelerator, model, tokenizer, out, record=None):  # noqa: ANN001, ANN202
        (out.with_name(".tmp_hf")).mkdir()  # the partial export of a process killed, or of a full disk
        raise CheckpointError(f"exporting the model to {out} failed: {os.strerror(errno.ENOSPC)}")

    monkeypatch.setattr(train, "export_hf", full_disk)
    forced = common + ["trainer.max_steps=6", "resume=force"]
    with pytest.raises(CheckpointError, match="exporting the model"):
        run_train(forced)
    assert json.loads((run / "hf" / EXPORT_MANIFEST).read_text())["step"] == 4  # the step-4 weights are still there
    with pytest.raises(CheckpointError) as err:  # and an evaluation does not report them as the run's
        evaluate.run(evaluate.compose([f"model={run}", "suites=[ppl]", "ppl.shards=x"]))
    assert str(err.value) == (f"{run / 'hf'} holds the weights of step 4, older than the run's newest checkpoint "
                              "step_000000006 (the export after it was interrupted or failed, or training goes on); "
                              "rerun the training command to export it again, or evaluate its newest checkpoint: "
                              f"model={run / 'checkpoints' / 'step_000000006'}")
    monkeypatch.setattr(train, "export_hf", real)
    out = run_train(forced)  # "finished: nothing to train", but the export is stale: exported again
    assert out["step"] == 6 and out["export"] == run / "hf"
    record = json.loads((run / "hf" / EXPORT_MANIFEST).read_text())
    assert (record["step"], record["tokens"], record["checkpoint"]) == (6, 6 * TOKENS_PER_STEP, "step_000000006")
    assert logits_rel_err(run / "hf", _step_model(run, 6)) < 1e-6
    assert not (run / ".tmp_hf").exists()
    assert resolve(run).trained == (6, 6 * TOKENS_PER_STEP)


def test_results_label_the_weights_evaluated_not_the_runs_latest_record(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)  # its metrics.jsonl ends at step 10, 40960 tokens
    ckpt, model = write_checkpoint(run, 4, 1.5)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 4, "tokens_seen": 512}))
    write_manifest(ckpt)
    meta = model_metadata(resolve(ckpt), model)
    assert (meta["step"], meta["tokens_trained"]) == (4, 512)
    # the run's export records step 4 while the run's records go on (a continuation training now)
    write_manifest(run / "hf", EXPORT_MANIFEST, {"step": 4, "tokens": 512, "checkpoint": ckpt.name})
    target = resolve(run)
    meta = model_metadata(target, load_model(target.hf_dir, device="cpu")[0])
    assert (meta["step"], meta["tokens_trained"]) == (4, 512)


def test_a_damaged_run_export_is_refused_and_keeps_the_good_results(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    write_manifest(run / "hf", EXPORT_MANIFEST, {"step": 10, "tokens": 40960, "checkpoint": None})
    shards = verse_shards(tmp_path, 40)
    args = [f"model={run}", "suites=[ppl]", f"ppl.shards={shards}", "ppl.seq_len=16", "progress=false"]
    good = evaluate.run(evaluate.compose(args))["reports"]["ppl"]
    weights = run / "hf" / "model.safetensors"
    _flip(weights)
    with pytest.raises(CheckpointError) as err:
        evaluate.run(evaluate.compose(args))
    assert str(err.value) == (f"the export {run / 'hf'} is damaged: {weights} fails its SHA-256 checksum; rerun the "
                              "training command to export it again (the checkpoints are untouched)")
    assert json.loads((run / "eval" / "ppl.json").read_text()) == good


def test_a_run_export_without_a_manifest_is_refused_when_the_run_has_checkpoints(tmp_path: Path) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    assert resolve(run).trained is None  # nothing to match it to: accepted, labelled by the run's records
    ckpt, _ = write_checkpoint(run, 12, 1.5)
    with pytest.raises(CheckpointError, match=rf"^{run / 'hf'} has no {EXPORT_MANIFEST}: its files cannot be "
                                              rf"verified .* evaluate its newest checkpoint: model={ckpt}$"):
        resolve(run)


def test_an_export_rewritten_in_place_while_it_is_loaded_is_refused(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    run = export_toy_run(tmp_path / "run", seq_len=64)
    weights = run / "hf" / "model.safetensors"
    real = evaluate.load_model

    def rewritten_in_place(hf_dir: Path, **kwargs: object) -> object:
        out = real(hf_dir, **kwargs)
        st = weights.stat()
        data = bytearray(weights.read_bytes())
        data[-64:] = bytes(b ^ 0x5A for b in data[-64:])
        with open(weights, "r+b") as f:  # same inode, same size
            f.write(bytes(data))
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # within one tick of a coarse clock
        assert (weights.stat().st_ino, weights.stat().st_size) == (st.st_ino, st.st_size)
        return out

    monkeypatch.setattr(evaluate, "load_model", rewritten_in_place)
    with pytest.raises(ValueError, match=rf"^{run / 'hf'} changed while it was hashed and loaded"):
        evaluate.build_context(evaluate.compose([f"model={run}", "suites=[ppl]"]))
