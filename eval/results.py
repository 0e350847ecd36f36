"""The results files of the evaluation suites: ``<model dir>/eval/<suite>.json``, one schema for every suite.

``{"schema", "suite", "model", "settings", "results", "summary", "wall_time_s", "date", "device", "versions"}``
(fields in :func:`suite_payload`). Files are written through a temp file and a rename,
so a crash never leaves a torn file; a suite's cells are written as they finish, and a rerun with the same
settings continues from them.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

SCHEMA = 1
SUITES = ("lm", "ruler", "retrieval", "ppl", "beta_eff")
# settings that change a number: a rerun that differs in one of them does not continue the old file
NUMBER_SETTINGS = ("max_length", "samples_per_cell", "seed", "tokenizer_sha256", "haystack", "max_new_tokens",
                   "context_tokens", "limit", "split", "seq_len", "shards", "n_seqs")
ROOT = Path(__file__).resolve().parents[1]


def git_commit(root: Path = ROOT) -> str | None:
    """The checkout's commit (``+dirty`` when tracked files differ), or ``None`` outside a git checkout.

    ``KDN_GIT_COMMIT``, when set, is returned instead: a working tree copied to another machine without its own
    ``.git`` (or with a stale one) names the commit it was copied from there."""
    if os.environ.get("KDN_GIT_COMMIT"):
        return os.environ["KDN_GIT_COMMIT"]
    try:
        sha = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return sha + ("+dirty" if dirty else "")


def versions(extra: tuple[str, ...] = ()) -> dict[str, str | None]:
    """Versions of the packages a number depends on (and of the distributions ``extra`` names), and this
    checkout's commit; ``None`` for a package that is not installed."""
    out: dict[str, str | None] = {}
    for pkg, dist in (("torch", "torch"), ("transformers", "transformers"), ("lm_eval", "lm_eval"),
                      ("fla", "flash-linear-attention"), ("triton", "triton"), ("datasets", "datasets"),
                      *((name, name) for name in extra)):
        try:
            out[pkg] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    out["kdn"] = git_commit()
    return out


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H200"``-style name of a CUDA device, else ``"cpu"``."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def sha256_text(text: str) -> str:
    """SHA-256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def suite_payload(suite: str, model: dict[str, Any], settings: dict[str, Any], results: dict[str, Any],
                  summary: dict[str, Any], wall_time_s: float, device: str) -> dict[str, Any]:
    """One results file: model metadata, the settings that produced the numbers, per-cell ``results``,
    the ``summary`` row, wall time, date (UTC), device and package versions."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: use one of {', '.join(SUITES)}")
    return {"schema": SCHEMA, "suite": suite, "model": model, "settings": settings, "results": results,
            "summary": summary, "wall_time_s": round(wall_time_s, 3),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "versions": versions()}


def differing_settings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The number-changing settings whose values differ between two results files' ``settings``."""
    return [k for k in NUMBER_SETTINGS if old.get(k) != new.get(k)]


def load_previous(path: Path, settings: dict[str, Any], overwrite: bool) -> dict[str, Any]:
    """The finished cells of an earlier run of this suite (``{}`` with ``overwrite`` or no file). A file written
    with different number-changing settings is refused, naming them and the way out."""
    if overwrite or not path.is_file():
        return {}
    try:
        old = json.loads(path.read_text())
    except json.JSONDecodeError:
        raise ValueError(f"{path} is not valid JSON; move it away or pass overwrite=true") from None
    diff = differing_settings(old.get("settings", {}), settings)
    if diff:
        raise ValueError(f"{path} was written with other settings ({', '.join(diff)}); pass overwrite=true to "
                         "replace it, or out_dir=<another folder> to keep both")
    return dict(old.get("results", {}))


class SampleLog:
    """Per-sample records ``<suite>.samples.jsonl`` (``cell``, ``index``, ``prompt_sha256``, ``answers``,
    ``prediction``, ``score``); each finished cell replaces its own lines, atomically."""

    def __init__(self, path: Path, enabled: bool, overwrite: bool) -> None:
        self.path, self.enabled = path, enabled
        if enabled and overwrite and path.exists():
            path.unlink()

    def write_cell(self, cell: str, rows: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        kept = []
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["cell"] != cell]
        lines = kept + [json.dumps({"cell": cell, **r}) for r in rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)
