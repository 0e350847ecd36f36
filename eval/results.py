"""The results files of the evaluation suites: ``<model dir>/eval/<suite>.json``, one schema for every suite.

``{"schema", "suite", "model", "weights", "settings", "results", "summary", "wall_time_s", "date", "device",
"versions"}`` (fields in :func:`suite_payload`). Files are written through a temp file and a rename, so a crash
never leaves a torn file; a suite's cells are written as they finish, and a rerun with the same settings on the same
weights continues from them. ``weights`` (``{"sha256", "files"}``, see :func:`eval.model_dir.weights_identity`)
names the weights every cell of the file was computed on: a file of other weights is never continued, its cells are
recomputed and replace it whole, so no file (and no summary) mixes two models. Concurrent evaluations of one model
share the file through :class:`ResultsFile`: each finished cell is merged in under a lock, and a cell one process
is computing is claimed, so that another skips it (and waits for it at the end) instead of computing it twice.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from importlib import metadata
from pathlib import Path
from typing import Any

from common import read_jsonl, write_atomic, write_json_atomic

SCHEMA = 1
SUITES = ("lm", "ruler", "retrieval", "ppl", "beta_eff")
# settings that change a number: a rerun that differs in one of them does not continue the old file
NUMBER_SETTINGS = ("max_length", "samples_per_cell", "seed", "tokenizer_sha256", "haystack", "max_new_tokens",
                   "context_tokens", "truncation", "limit", "split", "seq_len", "shards", "n_seqs")
ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("evaluate")


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


def sha256_text(text: str) -> str:
    """SHA-256 of a string's UTF-8 bytes."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def suite_payload(suite: str, model: dict[str, Any], weights: dict[str, Any], settings: dict[str, Any],
                  results: dict[str, Any], summary: dict[str, Any], wall_time_s: float, device: str) -> dict[str, Any]:
    """One results file: model metadata, the identity of the weights every cell was computed on, the settings that
    produced the numbers, per-cell ``results``, the ``summary`` row, wall time, date (UTC), device and package
    versions."""
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: use one of {', '.join(SUITES)}")
    return {"schema": SCHEMA, "suite": suite, "model": model, "weights": weights, "settings": settings,
            "results": results, "summary": summary, "wall_time_s": round(wall_time_s, 3),
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "device": device, "versions": versions()}


def differing_settings(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """The number-changing settings whose values differ between two results files' ``settings``."""
    return [k for k in NUMBER_SETTINGS if old.get(k) != new.get(k)]


def weights_sha256(doc: dict[str, Any]) -> str | None:
    """The SHA-256 of the weights a results file's cells were computed on (``None``: not recorded)."""
    weights = doc.get("weights")
    return weights.get("sha256") if isinstance(weights, dict) else None


def _read_doc(path: Path) -> dict[str, Any] | None:
    """The results file at ``path`` (``None`` when there is none); one that is not a JSON object is refused."""
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except json.JSONDecodeError:
        doc = None
    if not isinstance(doc, dict):
        raise ValueError(f"{path} is not valid JSON; move it away or pass overwrite=true")
    return doc


def _other_settings(path: Path, diff: list[str]) -> str:
    return (f"{path} was written with other settings ({', '.join(diff)}); pass overwrite=true to replace it, or "
            "out_dir=<another folder> to keep both")


def task_of(cell: str) -> str:
    """The task a cell belongs to: ``niah_single_1@4096`` -> ``niah_single_1`` (RULER); other cells are tasks."""
    return cell.split("@", 1)[0]


def stale_cells(doc: dict[str, Any], settings: dict[str, Any]) -> dict[str, str]:
    """``{cell: "old -> new"}`` for the cells of ``doc`` whose task ``settings["tasks"]`` gives another definition
    version than ``doc``'s settings record (no version recorded included): they are computed again, not reused."""
    new = settings.get("tasks")
    old = doc.get("settings", {}).get("tasks")
    if not isinstance(new, dict):
        return {}
    old = old if isinstance(old, dict) else {}
    return {c: f"{old.get(task_of(c), 'unrecorded')!r} -> {new[task_of(c)]!r}" for c in doc.get("results", {})
            if task_of(c) in new and (task_of(c) not in old or old[task_of(c)] != new[task_of(c)])}


def _current(doc: dict[str, Any], settings: dict[str, Any], path: Path) -> dict[str, Any]:
    """``doc``'s cells without those of other task definition versions (:func:`stale_cells`), said in one line."""
    stale = stale_cells(doc, settings)
    if stale:
        log.info("%s: recomputing %s, computed at other task definition versions (%s)", path, ", ".join(stale),
                 ", ".join(f"{c} {v}" for c, v in stale.items()))
    return {c: v for c, v in doc.get("results", {}).items() if c not in stale}


def load_previous(path: Path, settings: dict[str, Any], overwrite: bool, weights: dict[str, Any]) -> dict[str, Any]:
    """The finished cells of an earlier run of this suite that this one reuses: ``{}`` with ``overwrite``, without a
    file, or when the file's cells were computed on other weights than ``weights``; never a task's cell computed at
    another version of its definition than ``settings["tasks"]`` names (:func:`stale_cells`). A file written with
    different number-changing settings is refused, naming them and the way out."""
    doc = None if overwrite else _read_doc(path)
    if doc is None:
        return {}
    diff = differing_settings(doc.get("settings", {}), settings)
    if diff:
        raise ValueError(_other_settings(path, diff))
    if weights_sha256(doc) != weights["sha256"]:
        return {}
    return _current(doc, settings, path)


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

    ``start`` reads the file once: its cells are this evaluation's to reuse when they were computed with the same
    number-changing settings on the same weights; a file of other weights (or, with ``overwrite``, of other settings)
    is marked to be replaced. ``add`` merges one finished cell into the file under ``.locks/<suite>.lock``: it
    re-reads the file, keeps its cells of these settings and weights, drops those of the file being replaced, refuses
    a file that another evaluation of other settings or weights has written since ``start``, and writes through a
    temp file and a rename. ``claim(cell)`` holds ``.locks/<suite>.<cell>.claim`` while the cell is computed."""

    def __init__(self, out_dir: Path, suite: str, settings: dict[str, Any], weights: dict[str, Any]) -> None:
        self.path, self.suite, self.settings, self.weights = out_dir / f"{suite}.json", suite, settings, weights
        self.locks = out_dir / ".locks"
        self.replacing: dict[str, Any] | None = None  # the file found at start whose cells this evaluation replaces

    def lock(self) -> Any:
        """The lock every read-modify-write of this suite's files holds (a context manager)."""
        return file_lock(self.locks / f"{self.suite}.lock")

    def claim(self, cell: str, wait: bool = False) -> Any:
        """A context manager yielding whether this process now holds ``cell`` (``wait``: block until it does)."""
        safe = re.sub(r"[^A-Za-z0-9_.@-]", "_", cell)[:80]
        return file_lock(self.locks / f"{self.suite}.{safe}.{sha256_text(cell)[:8]}.claim", wait=wait)

    def _ours(self, doc: dict[str, Any]) -> bool:
        """Whether ``doc``'s cells were computed with these number-changing settings on these weights."""
        return not differing_settings(doc.get("settings", {}), self.settings) and \
            weights_sha256(doc) == self.weights["sha256"]

    def start(self, overwrite: bool) -> dict[str, Any]:
        """The finished cells in the file computed with these settings on these weights (``overwrite`` recomputes
        them all the same, leaving the file's other cells be). A file of other weights is replaced by this
        evaluation's cells, said in one log line; one of other settings is refused, or replaced with ``overwrite``;
        an unreadable one is refused, or removed with ``overwrite``."""
        with self.lock():
            try:
                doc = _read_doc(self.path)
            except ValueError:
                if not overwrite:
                    raise
                self.path.unlink()
                return {}
            if doc is None:
                return {}
            if self._ours(doc):
                return _current(doc, self.settings, self.path)
            diff = differing_settings(doc.get("settings", {}), self.settings)
            if diff and not overwrite:
                raise ValueError(_other_settings(self.path, diff))
            self.replacing = doc
            if not diff and doc.get("results"):
                was = (weights_sha256(doc) or "unrecorded")[:12]
                log.warning(f"{self.suite}: the {len(doc['results'])} cells of {self.path} were computed on other "
                            f"weights (sha256 {was}; these are {self.weights['sha256'][:12]}); recomputing the ones "
                            "asked for, the rest are dropped")
            return {}

    def _cells_of(self, doc: dict[str, Any] | None) -> dict[str, Any]:
        """The cells of ``doc`` this evaluation keeps: all of a file of its settings and weights, none of the file
        it replaces; a file of other settings or weights written since :meth:`start` is refused."""
        if doc is None:
            return {}
        if self._ours(doc):  # less the cells of other task definition versions, which the file no longer holds
            stale = stale_cells(doc, self.settings)
            return {c: v for c, v in doc.get("results", {}).items() if c not in stale}
        was = self.replacing
        if was is not None and not differing_settings(doc.get("settings", {}), was.get("settings", {})) and \
                weights_sha256(doc) == weights_sha256(was):
            return {}
        diff = differing_settings(doc.get("settings", {}), self.settings)
        if diff:
            raise ValueError(_other_settings(self.path, diff))
        raise ValueError(f"{self.path} was written meanwhile by an evaluation of other weights (sha256 "
                         f"{(weights_sha256(doc) or 'unrecorded')[:12]}; these are {self.weights['sha256'][:12]}); "
                         "evaluate one version of a model at a time, or pass out_dir=<another folder>")

    def read(self) -> dict[str, Any] | None:
        """The file as it is now when its cells are of these settings and weights, else ``None``; written by
        rename, so never torn."""
        doc = _read_doc(self.path)
        return doc if doc is not None and self._ours(doc) else None

    def cells(self) -> dict[str, Any]:
        """The finished cells of these settings and weights in the file now (see :meth:`_cells_of`)."""
        return self._cells_of(_read_doc(self.path))

    def add(self, cell: str, result: Any, rows: list[dict[str, Any]], samples: SampleLog,
            payload: Callable[[dict[str, Any], dict[str, Any]], dict[str, Any]]) -> dict[str, Any]:
        """Merge ``cell`` into the file as it is now; ``payload(results, settings)`` builds the file written.
        Returns that file."""
        with self.lock():
            old = _read_doc(self.path)
            results = self._cells_of(old) | {cell: result}
            kept = old.get("settings", {}) if old is not None and self._ours(old) else {}
            doc = payload(results, _merge_settings(kept, self.settings))
            try:
                samples.write_cell(cell, rows, set(results))
                write_json_atomic(self.path, doc)
            except OSError as e:
                raise ValueError(_write_failed(e, self.path, cell)) from None
        return doc


def _write_failed(e: OSError, path: Path, cell: str) -> str:
    """One line for a results write that failed: where, why (a full disk, a quota), what is kept, the fix."""
    where = Path(e.filename) if e.filename else path
    why = {errno.ENOSPC: f"the disk is full at {where.parent}", errno.EDQUOT: f"the disk quota is exceeded at "
           f"{where.parent}"}.get(e.errno or 0, f"{e.strerror or e}")
    return (f"writing {where} failed: {why}; the cell {cell} is not recorded and the cells already in {path} are "
            f"kept; free space there and rerun the command (finished cells are reused), or pass out_dir=<a folder "
            "on a disk with room>")


class SampleLog:
    """Per-sample records ``<suite>.samples.jsonl`` (``cell``, ``index``, ``prompt_sha256``, ``answers``,
    ``prediction``, ``score``); each finished cell replaces its own lines, atomically."""

    def __init__(self, path: Path, enabled: bool) -> None:
        self.path, self.enabled = path, enabled

    def write_cell(self, cell: str, rows: list[dict[str, Any]], cells: set[str]) -> None:
        """Replace ``cell``'s lines by ``rows`` (by none when the log is off) and drop the lines of cells not in
        ``cells``, the cells of the results file (the others were computed on other weights or settings)."""
        if not self.path.is_file() and not self.enabled:
            return
        kept = []
        if self.path.is_file():
            way_out = ("or move the file away: it holds only the per-sample records, and a new one is started (the "
                       "results files are not affected)")
            try:
                records = read_jsonl(self.path, on_torn=None)  # written whole by rename: no line is torn
            except ValueError as e:
                raise ValueError(f"{e}, {way_out}") from None
            for record in records:
                if not isinstance(record, dict) or not isinstance(record.get("cell"), str):
                    raise ValueError(f"{self.path} holds a record without a cell name ({str(record)[:60]}); repair "
                                     f"or remove that line, {way_out}")
            kept = [r for r in records if r["cell"] != cell and r["cell"] in cells]
        lines = [json.dumps(r) for r in kept] + ([json.dumps({"cell": cell, **r}) for r in rows] if self.enabled
                                                 else [])
        write_atomic(self.path, "".join(line + "\n" for line in lines))
