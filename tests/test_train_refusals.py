"""A refused train.py command leaves the run directory byte for byte as it was: Hydra's ``.hydra/`` copy of the
command, ``config.yaml`` and ``fingerprint.json`` are written only once the command is accepted."""
from __future__ import annotations

import json
import subprocess
from dataclasses import asdict
from pathlib import Path

import pytest
from conftest import timeout_s
from forkserver import command_env, commands
from toy_run import ROOT, TOY, make_cfg, run_train

from trainer.checkpoint import MANIFEST, STATE_FILE, CheckpointError, write_manifest
from trainer.rundir import LOCK_FILE, store_fingerprint


def snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under ``run_dir`` (relative path -> bytes)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*")) if p.is_file()}


def _cli(*args: str) -> subprocess.CompletedProcess:
    return commands().run(["train.py", *args], command_env(WANDB_MODE="disabled", OMP_NUM_THREADS="1"), ROOT,
                          timeout_s(300))


def test_a_refused_command_leaves_hydra_files_and_records_as_they_were(tmp_path: Path) -> None:
    """The run as an accepted command left it (its ``.hydra/`` copy, its config, a checkpoint); then a command with
    another learning rate, which the fingerprint refuses, and one with a bad value of a resumable key (the same
    run directory), which the config check refuses: Hydra has composed both, and neither writes anything."""
    run = tmp_path / "toy_recurrent_kdn_diag_mixer.mu=1"  # what the default name gives for these overrides
    (run / "checkpoints" / "step_000000002").mkdir(parents=True)
    (run / "checkpoints" / "step_000000002" / MANIFEST).write_text('{"files": {}}')
    store_fingerprint(run, asdict(make_cfg(["model=toy", "mixer.mu=1", "optim.lr=1e-3"])))
    (run / "config.yaml").write_text("optim:\n  lr: 0.001\n")
    (run / ".hydra").mkdir()
    for name, text in (("config.yaml", "optim:\n  lr: 0.001\n"), ("hydra.yaml", "hydra:\n  run: {}\n"),
                       ("overrides.yaml", "- model=toy\n- mixer.mu=1\n- optim.lr=1e-3\n")):
        (run / ".hydra" / name).write_text(text)
    (run / "train.log").write_text("[2026-12-01 10:00:00,000][train][INFO] - step 2: checkpoint ...\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 9.5}) + "\n")
    before = snapshot(run)

    refused = _cli("model=toy", "mixer.mu=1", "logging=quiet", f"runs_root={tmp_path}")
    assert refused.returncode == 2, refused.stderr[-3000:]
    assert refused.stderr.strip().splitlines()[-1] == (  # the default name holds the overrides
        f"run error: {run} holds another experiment (optim.lr: 0.001 -> 0.0004); start a new run with "
        "name=<new name>, or add resume=force to continue this run with the new settings")
    assert snapshot(run) == before

    bad = _cli("model=toy", "mixer.mu=1", "optim.lr=1e-3", "logging.wandb.mode=cloud", f"runs_root={tmp_path}")
    assert bad.returncode == 2, bad.stderr[-3000:]
    assert bad.stderr.strip().splitlines()[-1].startswith("config error: logging.wandb.mode: 'cloud' is not one of")
    assert snapshot(run) == before and not (run / LOCK_FILE).exists()


def test_a_checkpoint_the_command_cannot_resume_leaves_the_records_as_they_were(tmp_path: Path,
                                                                                shards: list[str]) -> None:
    """A refusal after the run directory's checks (the checkpoint was written by 2 processes, this command has 1)
    writes neither the command's config nor its fingerprint."""
    run = tmp_path / "r"
    args = TOY + shards + [f"run_dir={run}", "trainer.max_steps=4", "trainer.ckpt_every=1"]
    run_train(args + ["trainer.stop_after=1"])
    ckpt = run / "checkpoints" / "step_000000001"
    state = json.loads((ckpt / STATE_FILE).read_text())
    (ckpt / STATE_FILE).write_text(json.dumps({**state, "world_size": 2}))
    write_manifest(ckpt)  # intact: only the load can tell
    before = snapshot(run)
    with pytest.raises(CheckpointError, match="written by 2 processes"):
        run_train(args + ["trainer.stop_after=3", "trainer.keep_last=3"])  # resumable changes, recorded if accepted
    assert snapshot(run) == before
    out = run_train(args + ["trainer.stop_after=2", "trainer.reshard=true"])
    assert out["step"] == 2 and "stop_after: 2" in (run / "config.yaml").read_text()
