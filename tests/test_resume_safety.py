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
from toy_run import TOY, losses, rows, run_train, shard_overrides

from trainer.checkpoint import MANIFEST, Checkpointer, CheckpointError, TrainState, verify, write_manifest
from trainer.optim import warmup_cosine
from trainer.rundir import RunDirError


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    return shard_overrides(tmp_path_factory.mktemp("shards") / "embedded")


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


def test_a_full_disk_during_a_save_keeps_the_previous_checkpoint(
        tmp_path: Path, acc: tuple[Accelerator, torch.nn.Module], monkeypatch: pytest.MonkeyPatch) -> None:
    accelerator, model = acc
    ckpt = Checkpointer(tmp_path, keep_last=1, token="t")
    first = _save(ckpt, accelerator, model, 1)
    kept = {n: p.read_bytes() for n, p in ((p.name, p) for p in first.iterdir())}
    real_save = torch.save

    def full_disk(obj: object, f: object, *args: object, **kwargs: object) -> None:
        if str(f).endswith("optimizer.bin"):  # the model file is written; the disk fills up halfway through this one
            Path(str(f)).write_bytes(b"\x80" * 64)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(f))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(CheckpointError) as err:
        _save(ckpt, accelerator, model, 2)
    assert str(err.value) == (
        f"saving the checkpoint of step 2 under {tmp_path} failed (No space left on device); the previous checkpoint "
        f"{first} is intact: free space there and rerun the command to resume")
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == [first.name]  # no temp directory left taking space
    assert {p.name: p.read_bytes() for p in first.iterdir()} == kept and verify(first) is None
    assert ckpt.resume_point(accelerator) == first and ckpt.load(accelerator, first).step == 1
    assert _save(ckpt, accelerator, model, 2).name == "step_000000002"  # space again: the save goes through


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
