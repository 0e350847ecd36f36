"""Resumes that never lose or silently change anything: a run without an intact checkpoint is started over only on
request, refused or unreadable pickles (RNG states included) are named and never loaded, a full disk during a save
keeps the previous checkpoint, and a changed schedule or a finished run is said out loud."""
from __future__ import annotations

import errno
import json
import logging
import math
import os
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from toy_run import TOY, losses, rows, run_train

from trainer.checkpoint import MANIFEST, Checkpointer, CheckpointError, TrainState, verify, write_manifest
from trainer.optim import warmup_cosine
from trainer.rundir import RunDirError


@pytest.fixture()
def acc() -> tuple[Accelerator, torch.nn.Module]:
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = accelerator.prepare(model, opt)
    return accelerator, model


def _save(ckpt: Checkpointer, accelerator: Accelerator, model: torch.nn.Module, step: int) -> Path:
    with torch.no_grad():
        model.weight.add_(0.5)  # each checkpoint holds other weights
    return ckpt.save(accelerator, TrainState(step=step, tokens_seen=10 * step))


class _Planted:
    """A pickle that calls a global when loaded without the weights-only guard (here a harmless ``print``)."""

    def __reduce__(self) -> tuple:
        return (print, ("planted pickle ran",))


def _plant(path: Path) -> None:
    """Replace ``path`` by a pickle holding a global, and re-sign the manifest so that only the load can tell."""
    torch.save({"state": _Planted()}, path)
    write_manifest(path.parent)


def test_a_run_without_an_intact_checkpoint_is_started_over_only_on_request(
        tmp_path: Path, shards: list[str], caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "r"
    args = TOY + shards + [f"run_dir={run}", "trainer.max_steps=4", "trainer.ckpt_every=2"]
    run_train(args + ["trainer.stop_after=2"])
    model_bin = run / "checkpoints" / "step_000000002" / "pytorch_model.bin"
    model_bin.write_bytes(model_bin.read_bytes()[:-8] + bytes(8))  # damaged: the only checkpoint
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(CheckpointError, match=r"every checkpoint in .* is damaged .*resume=restart"):
        run_train(args)
    for _ in range(2):  # the rerun finds only the set-aside checkpoint and the records: refused, every time
        with pytest.raises(RunDirError) as err:
            run_train(args)
        assert str(err.value) == (
            f"{run} holds earlier training (records in metrics.jsonl; checkpoints set aside as damaged: "
            "step_000000002.corrupt) but no intact checkpoint to resume from; add resume=restart to start it over "
            "(its metrics are kept aside), or use another name=")
        assert (run / "metrics.jsonl").read_bytes() == before
    with caplog.at_level(logging.WARNING, logger="train"):
        out = run_train(args + ["resume=restart"])
    (kept,) = run.glob("metrics.*.jsonl")
    assert kept.read_bytes() == before  # the old records, whole, under a name nothing writes to
    assert f"resume=restart: {run} starts over from step 0" in caplog.text and kept.name in caplog.text
    assert out["finished"] and [r["step"] for r in losses(run)] == [1, 2, 3, 4]
    assert (run / "checkpoints" / "step_000000002.corrupt").is_dir()  # the damaged checkpoint stays aside
    assert run_train(args + ["resume=restart"])["step"] == 4  # with an intact checkpoint, restart resumes it
    assert list(run.glob("metrics.*.jsonl")) == [kept]


def test_a_missing_or_planted_rng_file_stops_or_sets_the_checkpoint_aside(
        tmp_path: Path, acc: tuple[Accelerator, torch.nn.Module], caplog: pytest.LogCaptureFixture) -> None:
    accelerator, model = acc
    ckpt = Checkpointer(tmp_path, keep_last=3, token="t")
    first, second = _save(ckpt, accelerator, model, 1), _save(ckpt, accelerator, model, 2)
    rng = second / "random_states_0.pkl"
    saved = rng.read_bytes()

    rng.unlink()  # gone, and left out of the manifest too: only the load can see it
    write_manifest(second)
    assert ckpt.resume_point(accelerator) == second
    with pytest.raises(CheckpointError) as err:
        ckpt.load(accelerator, second)
    assert str(err.value) == (f"{rng} is missing: the resume would not restore this process's random states; "
                              f"move {second} aside to resume from the previous checkpoint")

    for bad in ("planted", "unreadable"):
        if bad == "planted":
            _plant(rng)
        else:
            rng.write_bytes(saved[: len(saved) // 2])
            write_manifest(second)
        with pytest.raises(CheckpointError, match=rf"^{rng} is refused by a weights-only load or unreadable .*; "
                                                  rf"move {second} aside"):
            ckpt.load(accelerator, second)  # the load itself refuses it, without advising an unsafe load
        with caplog.at_level(logging.WARNING, logger="train"):
            assert ckpt.resume_point(accelerator) == first  # set aside, naming the file; the previous one resumes
        assert f"checkpoint {second} is damaged: {rng} is refused by a weights-only load" in caplog.text
        assert "weights_only=False" not in caplog.text
        os.replace(second.with_name(second.name + ".corrupt"), second)
        rng.write_bytes(saved)
        write_manifest(second)
        caplog.clear()
    assert verify(second) is None and ckpt.load(accelerator, second).step == 2


@pytest.mark.parametrize("name", ["optimizer.bin", "pytorch_model.bin"])
def test_a_planted_pickle_sets_the_checkpoint_aside_and_never_advises_an_unsafe_load(
        name: str, tmp_path: Path, acc: tuple[Accelerator, torch.nn.Module], caplog: pytest.LogCaptureFixture,
        capsys: pytest.CaptureFixture) -> None:
    accelerator, model = acc
    ckpt = Checkpointer(tmp_path, keep_last=3, token="t")
    first, second = _save(ckpt, accelerator, model, 1), _save(ckpt, accelerator, model, 2)
    _plant(second / name)
    with pytest.raises(CheckpointError) as err:
        ckpt.load(accelerator, second)
    assert "\n" not in str(err.value) and "weights_only=False" not in str(err.value)
    assert "Unsupported global" in str(err.value) or "unsupported GLOBAL" in str(err.value)
    with caplog.at_level(logging.WARNING, logger="train"):
        assert ckpt.resume_point(accelerator) == first
    assert f"{second / name} is refused by a weights-only load" in caplog.text
    assert "weights_only=False" not in caplog.text
    assert (tmp_path / "step_000000002.corrupt").is_dir()
    assert ckpt.load(accelerator, first).step == 1
    assert "planted pickle ran" not in capsys.readouterr().out


class _FillingWriter:
    """torch's archive writer on a disk that fills up: three records are written, the next write fails as torch
    reports it (a RuntimeError, not an OSError)."""

    def __init__(self, real: object, path: Path) -> None:
        self.real, self.path, self.records = real, path, 0

    def write_record(self, *args: object) -> None:
        if self.records == 3:
            assert self.path.is_file()  # the partial file is on the disk
            raise RuntimeError("[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing file "
                               "data/1: file write failed")
        self.records += 1
        self.real.write_record(*args)

    def __getattr__(self, name: str) -> object:
        return getattr(self.real, name)


def _fill_at_optimizer_bin(monkeypatch: pytest.MonkeyPatch) -> None:
    """The model file is written; the disk fills up halfway through ``optimizer.bin`` (torch's writer fails)."""
    real_open = torch.serialization._open_zipfile_writer

    def opener(f: object) -> object:
        opened = real_open(f)
        if str(f).endswith("optimizer.bin"):
            opened.file_like = _FillingWriter(opened.file_like, Path(str(f)))
        return opened

    monkeypatch.setattr(torch.serialization, "_open_zipfile_writer", opener)


def _fill_at_train_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """accelerate's files are written; the disk fills up at the fsync of ``train_state.json`` (an OSError)."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if Path(os.readlink(f"/proc/self/fd/{fd}")).name.startswith("train_state.json."):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("fill", [_fill_at_optimizer_bin, _fill_at_train_state])
def test_a_full_disk_during_a_save_is_one_line_and_keeps_the_previous_checkpoint(
        tmp_path: Path, acc: tuple[Accelerator, torch.nn.Module], monkeypatch: pytest.MonkeyPatch,
        fill: object) -> None:
    accelerator, model = acc
    ckpt = Checkpointer(tmp_path / "checkpoints", keep_last=1, token="t")
    first = _save(ckpt, accelerator, model, 1)
    kept = {n: p.read_bytes() for n, p in ((p.name, p) for p in first.iterdir())}
    fill(monkeypatch)
    with pytest.raises(CheckpointError) as err:
        _save(ckpt, accelerator, model, 2)
    monkeypatch.undo()
    torch_said = " (or over quota; torch: PytorchStreamWriter failed writing file data/1: file write failed)" \
        if fill is _fill_at_optimizer_bin else ""
    assert str(err.value) == (
        f"saving the checkpoint of step 2 failed: the disk is full at {ckpt.root}{torch_said}; the partial save is "
        f"removed and the previous checkpoint {first} is intact; free space there, or move {tmp_path} to a disk "
        "with room and pass run_dir=<its new path>, then rerun the command to resume")
    assert err.value.__cause__ is None and err.value.__suppress_context__  # no torch traceback under it
    assert sorted(p.name for p in ckpt.root.iterdir()) == [first.name]  # no temp directory left taking space
    assert {p.name: p.read_bytes() for p in first.iterdir()} == kept and verify(first) is None
    assert ckpt.resume_point(accelerator) == first and ckpt.load(accelerator, first).step == 1
    assert _save(ckpt, accelerator, model, 2).name == "step_000000002"  # space again: the save goes through


def test_an_error_other_than_a_failed_write_is_not_called_a_full_disk(
        tmp_path: Path, acc: tuple[Accelerator, torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, model = acc
    ckpt = Checkpointer(tmp_path, keep_last=1, token="t")
    first = _save(ckpt, accelerator, model, 1)

    def broken(*args: object, **kwargs: object) -> None:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    monkeypatch.setattr(torch, "save", broken)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        _save(ckpt, accelerator, model, 2)
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # the temp directory is removed all the same


def test_a_changed_schedule_is_refused_on_resume_and_a_finished_run_says_so(
        tmp_path: Path, shards: list[str], caplog: pytest.LogCaptureFixture) -> None:
    run = tmp_path / "s"
    common = TOY + shards + [f"run_dir={run}", "trainer.ckpt_every=0", "optim.warmup_frac=0.5"]
    run_train(common + ["trainer.max_steps=6", "trainer.stop_after=2"])
    for change in ("trainer.max_steps=8", "optim.min_lr_ratio=0.5", "optim.warmup_frac=0.25"):
        with pytest.raises(RunDirError, match=r"holds another experiment \((trainer\.max_steps: 6 -> 8|optim\.)"):
            run_train(common + ["trainer.max_steps=6", change])
    assert [r["step"] for r in losses(run)] == [1, 2]
    with caplog.at_level(logging.INFO, logger="train"):
        out = run_train(common + ["trainer.max_steps=8", "resume=force", "trainer.stop_after=3"])
    assert out["step"] == 3 and "resume=force: step 2 continues with trainer.max_steps: 6 -> 8" in caplog.text
    (event,) = [r for r in rows(run) if "event" in r]
    assert event == {"step": 2, "event": "resume_force", "changes": {"trainer.max_steps": [6, 8]}}
    lr3 = losses(run)[-1]["lr"]  # step 3 on the 8-step schedule (warm-up 4), not the 6-step one (warm-up 3)
    assert lr3 == pytest.approx(4e-4 * warmup_cosine(2, warmup_steps=math.ceil(0.5 * 8), total_steps=8,
                                                     min_ratio=0.1), rel=1e-12)

    assert run_train(common + ["trainer.max_steps=8"])["finished"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="train"):
        again = run_train(common + ["trainer.max_steps=8"])
    assert again["finished"] and again["step"] == 8
    assert f"{run} is finished: step 8 of 8 ({run / 'checkpoints' / 'step_000000008'}); nothing to train" in caplog.text
    assert "resumed from" not in caplog.text
    assert json.loads((run / "checkpoints" / "step_000000008" / "train_state.json").read_text())["step"] == 8
    assert [r["step"] for r in losses(run)] == list(range(1, 9))
    assert (run / "checkpoints" / "step_000000008" / MANIFEST).is_file()


class _Tokenizer:
    """Stands in for the run's tokenizer: one small file per export."""

    def save_pretrained(self, out: str) -> None:
        (Path(out) / "tokenizer.json").write_text("{}")


@pytest.mark.parametrize("error", [
    OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)),
    RuntimeError("Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: \"No space left on "
                 "device\" })"),  # safetensors' own error
])
def test_a_full_disk_during_an_export_is_one_line_and_keeps_the_earlier_export(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, error: Exception) -> None:
    import models
    from trainer.checkpoint import export_hf

    model = models.build_model(models.model_config("toy", "kdn_diag"))
    out = export_hf(Accelerator(cpu=True), model, _Tokenizer(), tmp_path / "hf")
    kept = {p.name: p.read_bytes() for p in out.iterdir()}
    real = type(model).save_pretrained

    def fails_midway(self, path, **kw):  # noqa: ANN001, ANN003, ANN202
        real(self, path, **kw)  # the partial export takes space, then the disk fills
        raise error

    monkeypatch.setattr(type(model), "save_pretrained", fails_midway)
    with pytest.raises(CheckpointError) as err:
        export_hf(Accelerator(cpu=True), model, _Tokenizer(), tmp_path / "hf")
    said = str(err.value)
    assert "\n" not in said and said.startswith(f"exporting the model to {out} failed: the disk is full at {tmp_path}")
    assert f"the earlier export {out} is intact" in said and err.value.__cause__ is None
    assert not (tmp_path / ".tmp_hf").exists(), "the partial export must not stay on the full disk"
    assert {p.name: p.read_bytes() for p in out.iterdir()} == kept


def test_an_export_error_other_than_a_failed_write_is_not_called_a_full_disk(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import models
    from trainer.checkpoint import export_hf

    model = models.build_model(models.model_config("toy", "kdn_diag"))

    def broken(self, path, **kw):  # noqa: ANN001, ANN003, ANN202
        raise ValueError("a bug, not the disk")

    monkeypatch.setattr(type(model), "save_pretrained", broken)
    with pytest.raises(ValueError, match="a bug, not the disk"):
        export_hf(Accelerator(cpu=True), model, _Tokenizer(), tmp_path / "hf")
    assert not (tmp_path / ".tmp_hf").exists()
