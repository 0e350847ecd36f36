"""The results files of the evaluation suites: ``<model dir>/eval/<suite>.json``, one schema for every suite.

``{"schema", "suite", "model", "settings", "results", "summary", "wall_time_s", "date", "device", "versions"}``
(fields in :func:`suite_payload`). Files are written through a temp file and a rename,
so a crash never leaves a torn file; a suite's cells are written as they finish, and a rerun with the same
settings continues from them. Concurrent evaluations of one model share the file through :class:`ResultsFile`:
each finished cell is merged in under a lock, and a cell one process is computing is claimed, so that another
skips it (and waits for it at the end) instead of computing it twice.
"""
from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from trainer.checkpoint import write_json_atomic

SCHEMA = 1
SUITES = ("lm", "ruler", "retrieval", "ppl", "beta_eff")
# settings that change a number: a rerun that differs in one of them does not continue the old file
NUMBER_SETTINGS = ("max_length", "samples_per_cell", "seed", "tokenizer_sha256", "haystack", "max_new_tokens",
                   "context_tokens", "truncation", "limit", "split", "seq_len", "shards", "n_seqs")
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


@contextmanager
def file_lock(path: Path, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created with its folder if needed) for the ``with`` block.

    Yields ``True`` while held; with ``wait=False`` yields ``False`` at once (holding nothing) when another process
    holds it. The kernel releases the lock when its holder exits or is killed, so no lock outlives a crash."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the lock


def _merge_settings(old: dict[str, Any], new: dict[str, Any]) -> dict[str, Any]:
    """``new`` with the lists and dicts of ``old`` kept: processes that ran different cells of one suite (other
    tasks, other RULER lengths) leave the union of their cells and task versions in the file."""
    out = dict(new)
    for key, was in old.items():
        now = new.get(key)
        if isinstance(was, dict) and isinstance(now, dict):
            out[key] = was | now
        elif isinstance(was, list) and isinstance(now, list):
            out[key] = was + [x for x in now if x not in was]
        elif key not in new:
            out[key] = was
    return out


class ResultsFile:
    """``<out_dir>/<suite>.json`` as shared by every evaluation of one model, concurrent ones included.

    ``add`` merges one finished cell into the file under ``.locks/<suite>.lock``: it re-reads the file, refuses it
    if another process wrote it with other number-changing settings, adds the cell and writes through a temp file
    and a rename. ``claim(cell)`` holds ``.locks/<suite>.<cell>.claim`` while the cell is computed."""

    def __init__(self, out_dir: Path, suite: str, settings: dict[str, Any]) -> None:
        self.path, self.suite, self.settings = out_dir / f"{suite}.json", suite, settings
        self.locks = out_dir / ".locks"

    def lock(self) -> Any:
        """The lock every read-modify-write of this suite's files holds (a context manager)."""
        return file_lock(self.locks / f"{self.suite}.lock")

    def claim(self, cell: str, wait: bool = False) -> Any:
        """A context manager yielding whether this process now holds ``cell`` (``wait``: block until it does)."""
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", cell)[:80]
        return file_lock(self.locks / f"{self.suite}.{safe}.{sha256_text(cell)[:8]}.claim", wait=wait)

    def start(self, overwrite: bool, samples: SampleLog) -> dict[str, Any]:
        """The finished cells to continue from; with ``overwrite`` the old file and sample log are removed first,
        so every cell found later was written by an evaluation running now."""
        with self.lock():
            if overwrite:
                self.path.unlink(missing_ok=True)
                samples.clear()
            return load_previous(self.path, self.settings, overwrite=False)

    def read(self) -> dict[str, Any] | None:
        """The file as it is now (``None`` when there is none); written by rename, so never torn."""
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None

    def cells(self) -> dict[str, Any]:
        """The finished cells in the file now, refusing a file written with other number-changing settings."""
        return load_previous(self.path, self.settings, overwrite=False)

    def add(self, cell: str, result: Any, rows: list[dict[str, Any]], samples: SampleLog,
            payload: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Merge ``cell`` into the file as it is now; ``payload(results, settings)`` builds the file written.
        Returns that file."""
        with self.lock():
            old = self.read() or {}
            results = self.cells() | {cell: result}
            doc = payload(results, _merge_settings(old.get("settings", {}), self.settings))
            samples.write_cell(cell, rows)
            write_json_atomic(self.path, doc)
        return doc


class SampleLog:
    """Per-sample records ``<suite>.samples.jsonl`` (``cell``, ``index``, ``prompt_sha256``, ``answers``,
    ``prediction``, ``score``); each finished cell replaces its own lines, atomically."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def clear(self) -> None:
        """Remove the log (a recomputation starts it afresh)."""
        if self.enabled:
            self.path.unlink(missing_ok=True)

    def write_cell(self, cell: str, rows: list[dict[str, Any]]) -> None:
        if not self.enabled:
            return
        kept = []
        if self.path.is_file():
            kept = [line for line in self.path.read_text().splitlines() if line and json.loads(line)["cell"] != cell]
        lines = kept + [json.dumps({"cell": cell, **r}) for r in rows]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.{os.getpid()}.tmp")
        tmp.write_text("".join(line + "\n" for line in lines))
        os.replace(tmp, self.path)
