"""Atomic, resumable checkpoints and the Hugging Face export.

A checkpoint is a directory ``<run_dir>/checkpoints/step_<9 digits>/`` holding accelerate's state
(model, optimiser, RNG states of every process; sharded under FSDP), ``train_state.json`` (step,
tokens seen, scheduler, the data loader's global cursor, the wandb run id) and, written last,
``manifest.json`` (every other file's size and SHA-256). It is written under ``.tmp_step_<step>.<token>``
(the token names the saving run; a save removes only its own temp directory) and renamed once complete.
A directory without a readable manifest is not a checkpoint. A resume verifies the newest checkpoint's
manifest and that each of its pickles passes a weights-only load; one that fails is set aside as ``step_*.corrupt``
with a warning naming the file, and the next newest intact one is used. Only the newest ``keep_last`` are kept,
never deleting the one just written. A save that fails removes its temp directory; a failed write (a full disk or
quota: an ``OSError``, or the ``RuntimeError`` torch's archive writer raises, e.g. "PytorchStreamWriter failed
writing file data/0: file write failed") becomes a one-line ``CheckpointError``; the checkpoints written before it
are untouched.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import pickle
import re
import shutil
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from torch import nn

from common import write_json_atomic
from data.shards import sha256_file

STATE_FILE = "train_state.json"
MANIFEST = "manifest.json"
# written last into a Hugging Face export (the run's hf/, a checkpoint's hf/): the weights' step and tokens, the
# checkpoint they came from, and every file's size and SHA-256, verified as a checkpoint's manifest is
EXPORT_MANIFEST = "export.json"
RNG_FILE = "random_states_{}.pkl"  # accelerate's RNG states of one process
_PICKLES = (".bin", ".pkl", ".pt")  # the files accelerate writes with torch.save
_STEP_DIR = re.compile(r"^step_(\d+)$")
# torch's archive writer (inline_container.cc) reports a failed write as a RuntimeError, not an OSError: a write that
# fails ("file write failed") or, at the archive's end, a short file ("unexpected pos")
_TORCH_WRITE_FAILED = re.compile(r"PytorchStreamWriter failed writing|file write failed|unexpected pos")
# safetensors (Rust) reports an I/O error inside its own exception's text
_STORAGE_FULL = re.compile(r"StorageFull|No space left on device|Disk quota exceeded|QuotaExceeded")
_FULL = {errno.ENOSPC: "the disk is full", errno.EDQUOT: "the disk quota is exceeded"}

log = logging.getLogger("train")


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from or written; the message is one line naming the file and the fix."""


@dataclass
class TrainState:
    """Everything besides tensors that a resume needs."""

    step: int = 0  # optimiser steps taken
    tokens_seen: int = 0
    wandb_id: str = ""
    world_size: int = 1
    scheduler: dict[str, Any] = field(default_factory=dict)
    loader: dict[str, Any] = field(default_factory=dict)  # data.TokenLoader state (the same on every rank)


def _sha256_all(paths: list[Path]) -> list[str]:
    """SHA-256 of each file, several files at once (hashlib releases the GIL: model and optimiser in parallel)."""
    with ThreadPoolExecutor(max_workers=max(1, min(8, len(paths)))) as pool:
        return list(pool.map(sha256_file, paths))


def write_manifest(ckpt_dir: Path, name: str = MANIFEST, record: dict[str, Any] | None = None
                   ) -> dict[str, dict[str, Any]]:
    """Record every file under ``ckpt_dir`` (size, SHA-256) in its manifest ``name``, beside the fields of
    ``record``; returns the entries."""
    paths = [p for p in sorted(ckpt_dir.rglob("*")) if p.is_file() and p.name != name]
    files = {str(p.relative_to(ckpt_dir)): {"size": p.stat().st_size, "sha256": h}
             for p, h in zip(paths, _sha256_all(paths))}
    write_json_atomic(ckpt_dir / name, {**(record or {}), "files": files})
    return files


def export_record(hf_dir: Path) -> dict[str, Any] | None:
    """The ``export.json`` of the export ``hf_dir`` (``None`` when it has none); an unreadable one is a
    ``CheckpointError`` naming it."""
    path = hf_dir / EXPORT_MANIFEST
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is unreadable ({type(e).__name__}): the export is incomplete or damaged; "
                              "export it again") from None
    if not isinstance(record, dict) or not isinstance(record.get("files"), dict) or not record["files"]:
        raise CheckpointError(f"{path} lists no files: the export is incomplete or damaged; export it again")
    return record


def export_problem(hf_dir: Path, step: int) -> str | None:
    """``None`` when ``hf_dir`` is a whole export of the weights after step ``step`` (its ``export.json`` names
    that step and every file passes its size and SHA-256); else what is wrong, in a few words."""
    if not hf_dir.is_dir():
        return "there is no export"
    try:
        record = export_record(hf_dir)
    except CheckpointError as e:
        return str(e)
    if record is None:
        return f"it has no {EXPORT_MANIFEST} (an interrupted export, or one from before exports carried one)"
    if record.get("step") != step:
        return f"it holds the weights of step {record.get('step')}, not of step {step}"
    return verify(hf_dir, manifest=EXPORT_MANIFEST)


def _write_failure(e: BaseException, where: Path) -> str | None:
    """What a failed write under ``where`` says in a few words (a full disk, a quota, torch's archive writer failing),
    or ``None`` when ``e`` is no write failure."""
    if isinstance(e, OSError):
        what = _FULL.get(e.errno or 0)
        return f"{what} at {where}" if what else f"writing under {where} failed ({e.strerror or e})"
    if isinstance(e, RuntimeError) and _TORCH_WRITE_FAILED.search(str(e)):
        said = next((x.strip() for x in str(e).splitlines() if _TORCH_WRITE_FAILED.search(x)), "")
        said = re.sub(r"^\[enforce fail at [^]]*\]\s*\.?\s*", "", said)  # the C++ source line means nothing here
        return f"the disk is full at {where} (or over quota; torch: {said})"
    if _STORAGE_FULL.search(str(e)):
        return f"the disk is full at {where} (or over quota; {type(e).__name__})"
    return None


def _refusal(e: Exception) -> str:
    """The line of a failed weights-only load that says what was refused (never torch's advice to load unsafely)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    named = [x for x in lines if re.search(r"unsupported global|weightsunpickler", x, re.IGNORECASE)]
    if named:
        return named[0].rstrip(".")
    return f"{type(e).__name__}" if not lines or "weights_only" in lines[0] else f"{type(e).__name__}: {lines[0]}"


def load_pickle(path: Path) -> Any:
    """``path`` loaded on the CPU as accelerate loads it (weights only, its numpy allow-list; memory-mapped when it is
    a zip archive, so a large file is not read). Raises ``CheckpointError`` naming the file when it is refused or
    unreadable."""
    from accelerate.utils import load

    try:
        return load(path, map_location="cpu", mmap=zipfile.is_zipfile(path))
    except Exception as e:  # a refused global, a torn archive, a truncated pickle: all mean "do not resume from it"
        raise CheckpointError(f"{path} is refused by a weights-only load or unreadable ({_refusal(e)})") from None


def check_pickles(ckpt_dir: Path) -> str | None:
    """``None`` if every pickle under ``ckpt_dir`` loads weights-only; else one line naming the first that fails."""
    for path in sorted(ckpt_dir.rglob("*")):
        if path.is_file() and path.suffix in _PICKLES:
            try:
                load_pickle(path)
            except CheckpointError as e:
                return str(e)
    return None


def verify(ckpt_dir: Path, checksum: bool = True, manifest: str = MANIFEST) -> str | None:
    """``None`` if every file of the manifest (``manifest.json``, or an export's ``export.json``) is there with its
    size (and, with ``checksum``, its SHA-256 and a weights-only load of each pickle); else one line naming the
    first file that fails."""
    try:
        files = json.loads((ckpt_dir / manifest).read_text())["files"]
    except (OSError, json.JSONDecodeError, KeyError, TypeError) as e:
        return f"{ckpt_dir / manifest} is missing or unreadable ({type(e).__name__})"
    for name, entry in files.items():
        path = ckpt_dir / name
        if not path.is_file():
            return f"{path} is missing"
        if (size := path.stat().st_size) != entry["size"]:
            return f"{path} has {size} bytes, the manifest says {entry['size']}"
    if checksum:
        paths = [ckpt_dir / name for name in files]
        for path, entry, got in zip(paths, files.values(), _sha256_all(paths)):
            if got != entry["sha256"]:
                return f"{path} fails its SHA-256 checksum"
        return check_pickles(ckpt_dir)
    return None


class Checkpointer:
    """Saves, verifies and finds the checkpoints of one run directory.

    Args:
        root: ``<run_dir>/checkpoints``.
        keep_last: how many of the newest checkpoints to keep.
        token: names this run's temp directories; the same on every process.
    """

    def __init__(self, root: Path | str, keep_last: int, token: str = "") -> None:
        if keep_last < 1:
            raise ValueError(f"trainer.keep_last must be >= 1, got {keep_last}")
        self.root = Path(root)
        self.keep_last = keep_last
        self.token = token or f"{os.getpid()}"

    def complete(self) -> list[Path]:
        """Checkpoints with a manifest, oldest first (not verified)."""
        if not self.root.is_dir():
            return []
        found = [(int(m.group(1)), p) for p in self.root.iterdir()
                 if (m := _STEP_DIR.match(p.name)) and (p / MANIFEST).is_file()]
        return [p for _, p in sorted(found)]

    def latest(self) -> Path | None:
        """The newest checkpoint with a manifest, or ``None``."""
        done = self.complete()
        return done[-1] if done else None

    def remove_stale_temps(self) -> None:
        """Delete the temp directories of saves that never finished (call only while holding the run lock)."""
        for stale in self.root.glob(".tmp_step_*") if self.root.is_dir() else ():
            log.warning(f"removing {stale}, the remains of an interrupted save")
            shutil.rmtree(stale)

    def _find_intact(self) -> tuple[str, str]:
        """(the newest intact checkpoint or "", an error when there were checkpoints and none is intact)."""
        for p in self.root.glob("step_*") if self.root.is_dir() else ():
            if _STEP_DIR.match(p.name) and p.is_dir() and not (p / MANIFEST).is_file():
                log.warning(f"{p} has no {MANIFEST}: it is not a complete checkpoint and is ignored")
        damaged = []
        for path in reversed(self.complete()):
            problem = verify(path)
            if problem is None:
                return str(path), ""
            aside = path.with_name(path.name + ".corrupt")
            if aside.exists():
                aside = path.with_name(f"{path.name}.{self.token}.corrupt")
            os.replace(path, aside)
            damaged.append(aside.name)
            log.warning(f"checkpoint {path} is damaged: {problem}; set aside as {aside}, trying the previous one")
        if damaged:
            return "", (f"every checkpoint in {self.root} is damaged (set aside as {', '.join(damaged)}); nothing "
                        "to resume from: restore a checkpoint from a copy, or start over with resume=restart (the "
                        "earlier metrics are kept aside) or under another name=")
        return "", ""

    def resume_point(self, accelerator: Accelerator) -> Path | None:
        """Collective: the newest checkpoint that passes its manifest (the main process verifies and tells the
        others), or ``None`` when there is none. Damaged checkpoints are renamed ``step_*.corrupt`` with a warning;
        a ``CheckpointError`` when every one is damaged (starting over would drop the run's records)."""
        found = list(self._find_intact()) if accelerator.is_main_process else ["", ""]
        if accelerator.num_processes > 1:
            from accelerate.utils import broadcast_object_list

            broadcast_object_list(found)
        if found[1]:
            raise CheckpointError(found[1])
        return Path(found[0]) if found[0] else None

    def save(self, accelerator: Accelerator, state: TrainState) -> Path:
        """Collective: every process calls it. Returns the final directory. A save that fails removes the temp
        directory; a failed write (a full disk, a quota, torch's writer) raises a one-line
        ``CheckpointError``; the checkpoints already there stay as they were."""
        final = self.root / f"step_{state.step:09d}"
        tmp = self.root / f".tmp_step_{state.step:09d}.{self.token}"
        try:
            if accelerator.is_main_process:
                self.root.mkdir(parents=True, exist_ok=True)
                if tmp.exists():  # this run's own earlier attempt at the same step
                    shutil.rmtree(tmp)
                tmp.mkdir()
            accelerator.wait_for_everyone()
            accelerator.save_state(str(tmp), safe_serialization=False)  # torch.save keeps tied weights as they are
            accelerator.wait_for_everyone()  # every rank's files (its RNG states) are written before the manifest
            if accelerator.is_main_process:
                write_json_atomic(tmp / STATE_FILE, asdict(state))
                write_manifest(tmp)  # last: a directory with a manifest is complete
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial save took
            problem = _write_failure(e, self.root)
            if problem is None:
                raise
            previous = self.latest()
            raise CheckpointError(
                f"saving the checkpoint of step {state.step} failed: {problem}; the partial save is removed and "
                f"{f'the previous checkpoint {previous} is intact' if previous else 'no earlier checkpoint exists'}; "
                f"{'free space there' if problem.startswith('the disk') else 'fix that'}, or move {self.root.parent} "
                "to a disk with room and pass run_dir=<its new path>, then rerun the command to resume") from None
        if accelerator.is_main_process:
            if final.exists():  # re-saving the step we resumed from: replace it whole
                shutil.rmtree(final)
            os.replace(tmp, final)
            for old in self.complete()[:-self.keep_last]:
                if old != final:
                    shutil.rmtree(old)
        accelerator.wait_for_everyone()
        return final

    @staticmethod
    def load(accelerator: Accelerator, path: Path, reshard: bool = False) -> TrainState:
        """Collective: restore model, optimiser and RNG states; return the ``TrainState``. A missing or refused file
        (this process's RNG states included: without them the resume is not exact) raises a one-line
        ``CheckpointError`` naming it."""
        fix = f"move {path} aside to resume from the previous checkpoint"
        try:
            state = TrainState(**json.loads((path / STATE_FILE).read_text()))
        except (OSError, json.JSONDecodeError, TypeError) as e:
            raise CheckpointError(f"{path / STATE_FILE} is unreadable ({e}); {fix}") from None
        if state.world_size != accelerator.num_processes and not reshard:
            raise CheckpointError(
                f"checkpoint {path} was written by {state.world_size} processes but this run has "
                f"{accelerator.num_processes}; an exact resume needs the same world size. Relaunch with "
                f"{state.world_size} processes, or set trainer.reshard=true to continue from the same data cursor.")
        rng = path / RNG_FILE.format(accelerator.process_index)
        if accelerator.process_index < state.world_size:  # a resharded run's new processes have none to restore
            if not rng.is_file():
                raise CheckpointError(f"{rng} is missing: the resume would not restore this process's random "
                                      f"states; {fix}")
            try:
                states = load_pickle(rng)
            except CheckpointError as e:
                raise CheckpointError(f"{e}; {fix}") from None
            if not isinstance(states, dict) or not {"random_state", "torch_manual_seed"} <= states.keys():
                raise CheckpointError(f"{rng} holds no random states; {fix}")
        try:
            accelerator.load_state(str(path))
        except pickle.UnpicklingError as e:  # torch's own message advises the unsafe weights_only=False
            raise CheckpointError(f"a file of {path} is refused by a weights-only load ({_refusal(e)}); "
                                  f"{fix}") from None
        return state


def export_hf(accelerator: Accelerator, model: nn.Module, tokenizer: Any, out_dir: Path,
              record: dict[str, Any] | None = None) -> Path:
    """Collective: write the model (``save_pretrained``, full weights even under FSDP) and the
    tokenizer (``save_pretrained``) to ``out_dir`` through a temp directory and a rename, with ``export.json``
    written last (``record``: the weights' ``step``, ``tokens``, ``checkpoint`` and its ``manifest_sha256``; and
    every file's size and SHA-256). A failed write (a full disk, a quota) removes the temp directory and raises a
    one-line ``CheckpointError``; an earlier export stays."""
    state_dict = accelerator.get_state_dict(model)
    tmp = out_dir.with_name(f".tmp_{out_dir.name}")
    if accelerator.is_main_process:
        try:
            if tmp.exists():
                shutil.rmtree(tmp)
            tmp.mkdir(parents=True)
            accelerator.unwrap_model(model).save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
            tokenizer.save_pretrained(str(tmp))
            write_manifest(tmp, EXPORT_MANIFEST, record)
        except Exception as e:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial export took
            problem = _write_failure(e, out_dir.parent)
            if problem is None:
                raise
            kept = f"the earlier export {out_dir} is intact" if out_dir.exists() else "no earlier export exists"
            raise CheckpointError(f"exporting the model to {out_dir} failed: {problem}; the partial export is removed "
                                  f"and {kept} (the checkpoints are untouched); free space there, then rerun the "
                                  "command") from None
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    accelerator.wait_for_everyone()
    return out_dir
