"""train.py end to end on the CPU with the toy model: exact resume, preemption, NaN stop, export, DDP parity."""
from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import free_port, timeout_s
from forkserver import Forked, command_env, commands
from hydra import compose, initialize_config_dir

from trainer.config import TrainConfig, load_config
from trainer.preemption import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "disabled")  # never touch the network

# toy model, 64-token windows, 2 sequences per micro-batch, 2 accumulation steps on one process
TOY = ["model=toy", "logging=quiet", "data.seq_len=64", "trainer.micro_batch_size=2",
       "trainer.global_batch_tokens=256", "trainer.eval_batches=2", "trainer.keep_last=5"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Overrides pointing at a 60k-token slice of the embedded corpus, prepared once."""
    out = tmp_path_factory.mktemp("shards") / "embedded"
    return [f"data.prepare.out_dir={out}", "data.prepare.max_tokens=60000", "data.prepare.num_workers=1"]


def make_cfg(overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return load_config(compose("config", overrides=overrides))


def run_train(overrides: list[str]) -> dict:
    from train import train

    return train(make_cfg(overrides))


def records(run_dir: Path) -> tuple[list[dict], list[dict]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "loss" in r], [r for r in rows if "val_loss" in r]


def weights(ckpt_dir: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt_dir / "pytorch_model.bin", map_location="cpu", weights_only=True)


def test_exact_resume_and_export(tmp_path: Path, shards: list[str]) -> None:
    common = TOY + shards + ["trainer.max_steps=6", "trainer.eval_every=3", "trainer.ckpt_every=0"]
    straight = run_train(common + [f"run_dir={tmp_path / 'a'}"])
    assert straight["finished"] and straight["step"] == 6
    first = run_train(common + [f"run_dir={tmp_path / 'b'}", "trainer.stop_after=3"])
    assert not first["finished"] and first["step"] == 3 and first["export"] is None
    second = run_train(common + [f"run_dir={tmp_path / 'b'}"])
    assert second["finished"]

    train_a, val_a = records(tmp_path / "a")
    train_b, val_b = records(tmp_path / "b")
    assert [r["step"] for r in train_b] == list(range(1, 7))
    assert [(r["loss"], r["lr"], r["grad_norm"]) for r in train_a] == [(r["loss"], r["lr"], r["grad_norm"])
                                                                       for r in train_b]  # bitwise
    assert [r["val_loss"] for r in val_a] == [r["val_loss"] for r in val_b]
    assert train_a[-1]["loss"] < train_a[0]["loss"]
    wa, wb = weights(straight["checkpoint"]), weights(second["checkpoint"])
    assert all(torch.equal(wa[k], wb[k]) for k in wa)
    state = json.loads((second["checkpoint"] / "train_state.json").read_text())
    assert state["step"] == 6 and state["tokens_seen"] == 6 * 256 and state["loader"]["cursor"] == 6 * 4
    assert state["wandb_id"] == json.loads((first["checkpoint"] / "train_state.json").read_text())["wandb_id"]

    # the Hugging Face export loads with the Auto classes and holds the final weights
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import models  # noqa: F401  (registers kdn_lm)
    from data import load_tokenizer

    hf = AutoModelForCausalLM.from_pretrained(straight["export"])
    exported = hf.state_dict()
    assert all(torch.equal(exported[k], wa[k]) for k in wa)
    text = "In the beginning God created the heaven and the earth."
    tok = AutoTokenizer.from_pretrained(straight["export"])
    assert tok(text, add_special_tokens=False)["input_ids"] == load_tokenizer("mistral-v1").encode(text)


def test_nan_loss_stops_and_keeps_the_last_checkpoint(tmp_path: Path, shards: list[str]) -> None:
    from train import NonFiniteLossError

    run = tmp_path / "nan"
    with pytest.raises(NonFiniteLossError, match=r"non-finite training loss at step \d.*last good checkpoint") as err:
        run_train(TOY + shards + [f"run_dir={run}", "trainer.max_steps=8", "trainer.ckpt_every=1",
                                  "trainer.eval_every=0", "optim.lr=1e30", "optim.warmup_frac=0"])
    ckpts = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert ckpts and all(name.startswith("step_") for name in ckpts)  # no half-written directory
    assert str(run / "checkpoints" / ckpts[-1]) in str(err.value)
    assert all(t.isfinite().all() for t in weights(run / "checkpoints" / ckpts[-1]).values())
    from train import refusal

    line, code = refusal(err.value)
    assert code == 1 and line == f"training error: {err.value}" and "\n" not in line


@pytest.mark.parametrize("error", ["NonFiniteLossError", "NonFiniteWeightsError"])
def test_train_py_ends_a_non_finite_run_in_one_line_and_exit_1(tmp_path: Path, error: str,
                                                               monkeypatch: pytest.MonkeyPatch,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    import train

    def diverge(cfg: object, hydra_files: object = None) -> None:
        raise getattr(train, error)("non-finite training loss at step 3 (loss=nan);\nlast good checkpoint: x")

    monkeypatch.setattr(train, "train", diverge)
    monkeypatch.setattr(sys, "argv", ["train.py", "--config-path", str(ROOT / "conf"), *TOY,
                                      f"run_dir={tmp_path / 'run'}", "hydra/job_logging=none",
                                      "hydra/hydra_logging=none"])
    with pytest.raises(SystemExit) as stop:
        train.main()
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        "training error: non-finite training loss at step 3 (loss=nan); last good checkpoint: x"]


def test_a_finite_loss_with_an_infinite_grad_norm_is_not_applied(tmp_path: Path, shards: list[str],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The guard looks at the gradient norm, not only at the loss: a step whose loss is finite but whose gradient
    norm is Inf stops the run before the optimiser touches the weights."""
    from accelerate import Accelerator

    from train import NonFiniteLossError

    real_clip, seen, before = Accelerator.clip_grad_norm_, [], []

    def clip(self: Accelerator, parameters: object, max_norm: float, norm_type: float = 2) -> torch.Tensor:
        params = list(parameters)
        norm = real_clip(self, params, max_norm, norm_type)
        seen.append(params)
        if len(seen) == 3:  # step 3: finite loss and gradients, an Inf norm
            before.extend(p.detach().clone() for p in params)
            return torch.full_like(norm, float("inf"))
        return norm

    monkeypatch.setattr(Accelerator, "clip_grad_norm_", clip)
    run = tmp_path / "inf_grad"
    with pytest.raises(NonFiniteLossError, match=r"at step 3 \(loss=[0-9.]+, grad_norm=inf.*not applied"):
        run_train(TOY + shards + [f"run_dir={run}", "trainer.max_steps=5", "trainer.ckpt_every=1",
                                  "trainer.eval_every=0", "trainer.export=false"])
    assert len(before) == len(seen[2]) > 0
    assert all(torch.equal(p.detach(), b) for p, b in zip(seen[2], before))  # the update was not applied
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000000001", "step_000000002"]
    assert [r["step"] for r in records(run)[0]] == [1, 2]


def test_varlen_batches_train(tmp_path: Path, shards: list[str]) -> None:
    out = run_train(TOY + shards + [f"run_dir={tmp_path / 'v'}", "data.varlen=true", "trainer.max_steps=2",
                                     "trainer.eval_every=0", "trainer.export=false"])
    losses = [r["loss"] for r in records(tmp_path / "v")[0]]
    assert out["finished"] and len(losses) == 2 and all(8 < x < 12 for x in losses)


def test_profile_window_writes_a_summary_and_trace(tmp_path: Path, shards: list[str]) -> None:
    run = tmp_path / "p"
    out = run_train(TOY + shards + [f"run_dir={run}", "trainer.max_steps=3", "trainer.eval_every=0",
                                     "trainer.export=false", "logging.profile.start=1", "logging.profile.steps=1"])
    summary = json.loads((run / "profile" / "summary.json").read_text())
    assert out["finished"] and summary["steps"] == [2, 2] and summary["wall_ms"] > 0
    assert summary["top"] and all(t["name"].startswith("aten::") and t["ms"] >= 0 for t in summary["top"])
    assert summary["safe_gate_reads"] == {"tensor_core": 0, "token_loop": 0}  # the CPU path makes no check
    speeds = [r["tokens_per_s"] for r in records(run)[0]]  # one record a step (logging=quiet)
    assert speeds[0] > 0 and speeds[1] is None and speeds[2] > 0  # the profiled step's interval has no speed
    import gzip

    trace = json.loads(gzip.decompress((run / "profile" / "trace.json.gz").read_bytes()))
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    with pytest.raises(Exception, match="logging.profile.steps: must be >= 0"):
        make_cfg(TOY + ["logging.profile.steps=-1"])


def _cli(args: list[str]) -> Forked:
    """``python *args`` with its stderr in its stdout."""
    return commands().start(args, command_env(WANDB_MODE="disabled", OMP_NUM_THREADS="1"), ROOT, merge_stderr=True)


def test_sigusr1_saves_at_step_boundary_and_requeues(tmp_path: Path, shards: list[str]) -> None:
    run = tmp_path / "pre"
    # more steps than the toy takes within the test's time limits: the signal, not the end, stops it however
    # slowly this process polls
    steps = 10 ** 9
    args = ["train.py", *TOY, *shards, f"run_dir={run}", f"trainer.max_steps={steps}", "trainer.eval_every=0",
            "trainer.ckpt_every=0"]
    proc = _cli(args)
    metrics = run / "metrics.jsonl"
    deadline = time.time() + timeout_s(240)
    while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 2):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[0][-3000:]
        time.sleep(0.2)
    proc.send_signal(signal.SIGUSR1)
    out = proc.communicate(timeout=timeout_s(240))[0]
    assert proc.returncode == REQUEUE_EXIT_CODE, out[-3000:]
    (ckpt,) = (run / "checkpoints").iterdir()
    saved = json.loads((ckpt / "train_state.json").read_text())["step"]
    logged = [r["step"] for r in records(run)[0]]
    assert 2 <= saved < steps and logged[-1] == saved  # saved right after the step the signal interrupted
    overrides = (run / ".hydra" / "overrides.yaml").read_text()  # Hydra's record of the accepted command
    assert overrides.startswith("- model=toy\n") and "stop_after" not in overrides
    # the requeued job resumes from that step
    proc = _cli([*args, f"trainer.stop_after={saved + 2}"])
    out = proc.communicate(timeout=timeout_s(240))[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed from {ckpt}" in out
    assert [r["step"] for r in records(run)[0]] == list(range(1, saved + 3))
    assert f"- trainer.stop_after={saved + 2}\n" in (run / ".hydra" / "overrides.yaml").read_text()
    assert f"stop_after: {saved + 2}\n" in (run / ".hydra" / "config.yaml").read_text()
    assert f"output_dir: {run}\n" in (run / ".hydra" / "hydra.yaml").read_text()


def test_two_process_ddp_matches_one_process_accumulation(tmp_path: Path, shards: list[str]) -> None:
    """Same global batch: 1 process x 2 accumulation steps vs 2 processes (gloo) x 1 read the same windows per
    step (the loader gives rank r the r-th block), so the losses agree to FP32 rounding. The 2-process run
    stops after 2 steps and one process resumes it (trainer.reshard=true) for step 3. The validation at step 2
    covers the same windows (trainer.eval_batches counts micro-batches over all processes)."""
    common = [*TOY, *shards, "trainer.max_steps=3", "trainer.eval_every=2", "trainer.eval_batches=4",
              "trainer.export=false"]
    one = run_train([*common, f"run_dir={tmp_path / 'one'}"])
    assert one["finished"]
    proc = _cli(["-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "train.py",
                 *common, f"run_dir={tmp_path / 'two'}", "trainer.stop_after=2"])
    out = proc.communicate(timeout=timeout_s(300))[0]
    assert proc.returncode == 0, out[-3000:]
    assert "2 process(es) x 1 accumulation" in out
    with pytest.raises(ValueError, match="written by 2 processes"):
        run_train([*common, f"run_dir={tmp_path / 'two'}"])
    assert run_train([*common, f"run_dir={tmp_path / 'two'}", "trainer.reshard=true"])["finished"]
    l1 = [r["loss"] for r in records(tmp_path / "one")[0]]
    l2 = [r["loss"] for r in records(tmp_path / "two")[0]]
    assert len(l1) == len(l2) == 3
    assert l1 == pytest.approx(l2, rel=1e-5, abs=0)
    v1, v2 = ([r["val_loss"] for r in records(tmp_path / d)[1] if r["step"] == 2] for d in ("one", "two"))
    assert len(v1) == len(v2) == 1 and v1 == pytest.approx(v2, rel=1e-5, abs=0)


@pytest.mark.gpu
def test_gpu_bf16_run_reports_mfu_and_memory(tmp_path: Path, shards: list[str]) -> None:
    out = run_train(TOY + shards + [f"run_dir={tmp_path / 'g'}", "trainer.device=cuda", "trainer.max_steps=4",
                                     "trainer.eval_every=0", "trainer.export=false"])
    rows = records(tmp_path / "g")[0]
    assert out["finished"] and len(rows) == 4 and all(8 < r["loss"] < 12 for r in rows)
    assert all(r["peak_mem_gib"] > 0 for r in rows)
    if "H100" in torch.cuda.get_device_name() or "H200" in torch.cuda.get_device_name():
        assert all(0 < r["mfu"] < 1 for r in rows)


def test_auto_prepare_on_a_full_disk_ends_in_one_line_and_exit_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    import errno

    import train

    shard = tmp_path / "shards" / "train_00003.bin"

    def full_disk(cfg: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device", str(shard))

    monkeypatch.setattr(train, "prepare", full_disk)
    monkeypatch.setattr(sys, "argv", ["train.py", "--config-path", str(ROOT / "conf"), *TOY,
                                      f"run_dir={tmp_path / 'run'}", f"data.prepare.out_dir={tmp_path / 'shards'}",
                                      "hydra/job_logging=none", "hydra/hydra_logging=none"])
    with pytest.raises(SystemExit) as stop:
        train.main()
    assert stop.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"data error: data.prepare: {shard}: No space left on device; free space there or pass out_dir= on a disk "
        "with room, then run the same command again (finished chunks are kept, nothing half-written is)"]
