"""Metrics: JSONL always, wandb (offline unless configured online), and a console progress line.

Every record is one JSON object per line in ``<run_dir>/metrics.jsonl`` with at least ``step``;
training records add ``loss, lr, grad_norm, tokens, tokens_per_s, tokens_per_s_per_device, mfu,
eta_s`` (and ``peak_mem_gib`` on CUDA; the speed fields are ``null`` for an interval that held profiled steps,
``logging.profile``), validation records ``val_loss``, and events (``event``: e.g. ``resume_force`` with the
adopted ``changes``) neither.
"""
from __future__ import annotations

import json
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from common import read_jsonl, write_atomic

log = logging.getLogger("train")

# Dense bf16 tensor-core peak per device (FLOP/s), matched by substring of the CUDA device name.
BF16_PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12, "L40S": 362e12, "A6000": 154.8e12}


def peak_flops(device: torch.device, precision: str, override: float | None) -> float | None:
    """Peak FLOP/s of one device for the MFU denominator: ``override`` if given, else the bf16
    table for known CUDA devices, else ``None`` (MFU not reported)."""
    if override is not None:
        return override
    if device.type != "cuda" or precision != "bf16":
        return None
    name = torch.cuda.get_device_name(device)
    return next((v for k, v in BF16_PEAK_FLOPS.items() if k in name), None)


def format_eta(seconds: float) -> str:
    """``3725.0 -> '1:02:05'``."""
    if not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"


def log_torn(path: Path, line: int, _: str) -> None:
    """:func:`common.read_jsonl`'s ``on_torn`` for the run's own records: a warning in the training log."""
    log.warning(f"{path}:{line}: dropping a torn last line (the run stopped while writing it)")


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Drop records with ``step > last_step`` (written after the checkpoint we resume from) and a torn last line."""
    if not path.is_file():
        return
    keep = [r for r in read_jsonl(path, on_torn=log_torn) if r["step"] <= last_step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


class MetricLogger:
    """Writes records on the main process only; the other processes hold a disabled logger."""

    def __init__(
        self, run_dir: Path, *, enabled: bool, resume_step: int, total_steps: int, progress: bool,
        wandb_mode: str, wandb_project: str, wandb_entity: str | None, wandb_id: str, run_name: str,
        config: dict[str, Any],
    ) -> None:
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.bar = None
        if not enabled:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.path, resume_step)
        self.file = self.path.open("a")
        if wandb_mode != "disabled":
            try:
                import wandb
            except ImportError as e:
                raise ImportError(f"logging.wandb.mode={wandb_mode} needs wandb: pip install wandb, "
                                  "or set logging.wandb.mode=disabled (JSONL metrics only)") from e

            self.wandb_run = wandb.init(
                project=wandb_project, entity=wandb_entity, name=run_name, id=wandb_id, resume="allow",
                dir=str(run_dir), mode=wandb_mode, config=config)
        if progress and sys.stderr.isatty():
            self.bar = tqdm(total=total_steps, initial=resume_step, desc=run_name, dynamic_ncols=True)

    def log(self, record: dict[str, Any]) -> None:
        """Append one record (JSONL, wandb) and refresh the console line if it is a training record."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step" and v is not None},
                               step=record["step"])
        if "val_loss" in record:
            msg = f"step {record['step']} | val_loss {record['val_loss']:.4f}"
            if self.bar is not None:
                self.bar.write(msg)
            else:
                log.info(msg)
            return
        mfu, tok_s, eta = record.get("mfu"), record.get("tokens_per_s"), record.get("eta_s")
        fields = (f"loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
                  f"tok/s {'n/a' if tok_s is None else f'{tok_s:,.0f}'} | "
                  f"mfu {'n/a' if mfu is None else f'{100 * mfu:.1f}%'}")
        if self.bar is not None:
            self.bar.set_postfix_str(fields, refresh=False)
        else:
            log.info(f"step {record['step']} | {fields} | eta {format_eta(math.nan if eta is None else eta)}")

    def event(self, record: dict[str, Any]) -> None:
        """Append a record that is neither training nor validation (``step``, ``event`` and its fields)."""
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def advance(self, step: int) -> None:
        """Move the progress bar to ``step``."""
        if self.bar is not None:
            self.bar.update(step - self.bar.n)

    def close(self) -> None:
        """Flush and close everything (idempotent)."""
        if not self.enabled:
            return
        self.enabled = False
        self.file.close()
        if self.bar is not None:
            self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()

    def __enter__(self) -> MetricLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
