"""Atomic, resumable checkpoints and the Hugging Face export.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<9 digits>/`` holding accelerate's state
(model, optimiser, RNG states of every process; sharded under FSDP) and ``train_state.json`` (step,
tokens seen, scheduler, the data loader's global cursor, the wandb run id). It is
written under ``.tmp_step_*`` and renamed once complete, so a directory named ``step_*`` is always
whole; only the newest ``keep_last`` are kept.
"""
from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

STATE_FILE = "train_state.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass
class TrainState:
    """Everything besides tensors that a resume needs."""

    step: int = 0  # optimiser steps taken
    tokens_seen: int = 0
    wandb_id: str = ""
    world_size: int = 1
    scheduler: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, Any] = field(default_factory=dict)  # data.TokenLoader state (the same on every rank)


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write ``obj`` as JSON to ``path`` through a temp file and a rename."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


class Checkpointer:
    """Saves and finds the checkpoints of one run directory."""

    def __init__(self, root: Path | str, keep_last: int) -> None:
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last

    def complete(self) -> list[Path]:
        """Finished checkpoints, oldest first."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest finished checkpoint, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def save(self, accelerator: Accelerator, state: TrainState) -> Path:
        """Collective: every process calls it. Returns the final directory."""
        final = self.root / f"step_{state.step:09d}"
        tmp = self.root / f".tmp_step_{state.step:09d}"
        if accelerator.is_main_process:
            self.root.mkdir(parents=True, exist_ok=True)
            for stale in self.root.glob(".tmp_step_*"):
                shutil.rmtree(stale)
            tmp.mkdir()
        accelerator.wait_for_everyone()
        accelerator.save_state(str(tmp), safe_serialization=False)  # torch.save keeps tied weights as they are
        accelerator.wait_for_everyone()  # every rank's files (its RNG states) are written before the rename
        if accelerator.is_main_process:
            write_json_atomic(tmp / STATE_FILE, asdict(state))
            if final.exists():  # re-saving the step we resumed from: replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in self.complete()[:-self.keep_last]:
                shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return final

    @staticmethod
    def load(accelerator: Accelerator, path: Path, reshard: bool = False) -> TrainState:
        """Collective: restore model, optimiser and RNG states; return the ``TrainState``."""
        state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        if state.world_size != accelerator.num_processes and not reshard:
            raise ValueError(
                f"checkpoint {path} was written by {state.world_size} processes but this run has "
                f"{accelerator.num_processes}; an exact resume needs the same world size. Relaunch with "
                f"{state.world_size} processes, or set trainer.reshard=true to continue from the same data cursor.")
        accelerator.load_state(str(path))
        return state


def export_hf(accelerator: Accelerator, model: nn.Module, tokenizer: Any, out_dir: Path) -> Path:
    """Collective: write the model (``save_pretrained``, full weights even under FSDP) and the
    tokenizer (``save_pretrained``) to ``out_dir`` through a temp directory and a rename."""
    state_dict = accelerator.get_state_dict(model)
    tmp = out_dir.with_name(f".tmp_{out_dir.name}")
    if accelerator.is_main_process:
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
        accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(str(tmp))
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
