"""Short train.py runs of the toy model for the run-directory tests (compose, train, read the metrics); their data:
the ``shards`` fixture of tests/conftest.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

from hydra import compose, initialize_config_dir

from trainer.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("WANDB_MODE", "disabled")  # never touch the network

# toy model, 64-token windows, 2 sequences per micro-batch, 2 accumulation steps on one process, no export
TOY = ["model=toy", "logging=quiet", "data.seq_len=64", "trainer.micro_batch_size=2",
       "trainer.global_batch_tokens=256", "trainer.eval_batches=2", "trainer.eval_every=0", "trainer.export=false"]


def make_cfg(overrides: list[str]) -> TrainConfig:
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return load_config(compose("config", overrides=overrides))


def run_train(overrides: list[str]) -> dict:
    from train import train

    return train(make_cfg(overrides))


def rows(run_dir: Path) -> list[dict]:
    """Every record of ``run_dir/metrics.jsonl``."""
    return [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def losses(run_dir: Path) -> list[dict]:
    """The training records."""
    return [r for r in rows(run_dir) if "loss" in r]
