"""What is being evaluated: a run directory, its ``hf/`` export, or one of its checkpoints (verified, exported first).

``resolve(path)`` -> :class:`Target` (the run directory, the Hugging Face directory to load, where results go, the
checkpoint step); ``weights_identity(hf_dir)`` -> the ``weights`` block of every results file (what the numbers
were computed on); ``model_metadata(target, model)`` -> the ``model`` block.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common import read_jsonl
from data.shards import sha256_file
from eval.results import file_lock, git_commit, sha256_text
from trainer.checkpoint import (
    EXPORT_MANIFEST,
    MANIFEST,
    STATE_FILE,
    Checkpointer,
    CheckpointError,
    export_record,
    load_pickle,
    verify,
)

log = logging.getLogger("evaluate")
DEFAULT_MAX_LENGTH = 4096  # the paper's training context (docs/protocol.md §8)
# the files of a Hugging Face export that its numbers depend on (the tokenizer's SHA-256 is a setting of its own)
MODEL_FILES = ("config.json", "*.safetensors", "*.safetensors.index.json", "pytorch_model*.bin",
               "pytorch_model*.bin.index.json")
_STEP_DIR = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class Target:
    """``hf_dir``: the model to load; ``run_dir``: its training run (``None`` for a bare export); ``out_dir``:
    where ``<suite>.json`` go; ``step``: the checkpoint's step (``None`` for the final export); ``trained``: the
    ``(step, tokens)`` of the weights loaded, as their checkpoint or export records them (``None``: unrecorded)."""

    hf_dir: Path
    run_dir: Path | None
    out_dir: Path
    step: int | None = None
    trained: tuple[int | None, int | None] | None = None


def _run_config(run_dir: Path | None) -> dict[str, Any]:
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(run_dir / "config.yaml"), resolve=False) or {}


def model_files(hf_dir: Path) -> list[Path]:
    """The config and weight files of the export ``hf_dir`` (:data:`MODEL_FILES`), sorted."""
    return sorted({p for pattern in MODEL_FILES for p in hf_dir.glob(pattern) if p.is_file()})


def weights_identity(hf_dir: Path) -> dict[str, Any]:
    """``{"sha256", "files"}``: the SHA-256 of each of the export's :func:`model_files` and one digest over them,
    the identity of the weights a results file's cells were computed on. A pickled weights file is first loaded
    weights-only, as a resume checks a checkpoint's: a refused one raises the ``CheckpointError`` naming it."""
    paths = model_files(hf_dir)
    for path in paths:
        if path.suffix == ".bin":
            load_pickle(path)
    files = {p.name: sha256_file(p) for p in paths}
    return {"sha256": sha256_text("".join(f"{name} {h}\n" for name, h in files.items())), "files": files}


@contextmanager
def model_files_unchanged(hf_dir: Path) -> Iterator[dict[str, Any]]:
    """Yields :func:`weights_identity` of ``hf_dir``; refuses (``ValueError``) when the export's model files are
    replaced or rewritten during the ``with`` block (a training run exporting into the same folder): the weights
    hashed would not be the weights loaded. The files are hashed again at the end, since a rewrite in place within
    one tick of the file system's clock keeps the inode, the size and the modification time."""
    def stamp() -> list[tuple[str, int, int, int]]:
        return [(p.name, (st := p.stat()).st_ino, st.st_size, st.st_mtime_ns) for p in model_files(hf_dir)]

    before = stamp()
    weights = weights_identity(hf_dir)
    yield weights
    if stamp() != before or weights_identity(hf_dir) != weights:
        raise ValueError(f"{hf_dir} changed while it was hashed and loaded (is a training run exporting into it?); "
                         "rerun the evaluation once the export is written")


def _verified_checkpoint(ckpt: Path) -> str:
    """The SHA-256 of ``ckpt``'s manifest once the checkpoint passes it as a resume verifies it (every file's size
    and SHA-256, a weights-only load of each pickle); else a one-line ``CheckpointError`` naming the file that
    fails. The checkpoint is left in place: training's resume, not an evaluation, sets damaged ones aside."""
    if not (ckpt / MANIFEST).is_file():
        raise CheckpointError(f"{ckpt} has no {MANIFEST}: it is not a complete checkpoint (its save did not finish; "
                              "training ignores it); evaluate another checkpoint")
    problem = verify(ckpt)
    if problem is not None:
        raise CheckpointError(f"checkpoint {ckpt} is damaged: {problem}; evaluate another checkpoint, or restore "
                              f"this one from a copy (a resume of the run sets it aside as {ckpt.name}.corrupt)")
    return sha256_file(ckpt / MANIFEST)


def export_complete(ckpt: Path, manifest_sha256: str | None = None) -> bool:
    """Whether ``ckpt/hf`` is a finished export of the checkpoint as it is now: its ``export.json`` names the
    SHA-256 of the checkpoint's manifest (``manifest_sha256``, read from ``ckpt`` when not given) and every file
    with its size and SHA-256."""
    hf_dir = ckpt / "hf"
    try:
        record = json.loads((hf_dir / EXPORT_MANIFEST).read_text())
        files = record["files"]
        if not files or record["manifest_sha256"] != (manifest_sha256 or sha256_file(ckpt / MANIFEST)):
            return False
        if not all((hf_dir / name).is_file() and (hf_dir / name).stat().st_size == entry["size"]
                   for name, entry in files.items()):
            return False
        return all(sha256_file(hf_dir / name) == entry["sha256"] for name, entry in files.items())
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False


def _export_checkpoint(ckpt: Path, run_dir: Path) -> Path:
    """``<checkpoint>/hf`` from a verified checkpoint's weights and the run's config, exported once per checkpoint.

    The checkpoint is verified first (:func:`_verified_checkpoint`). The export is written under a temp name, given
    its ``export.json`` (the checkpoint manifest's SHA-256, each file's size and SHA-256) and renamed into place,
    under ``<checkpoint>/.hf.lock`` so that concurrent evaluations export it once. An ``hf/`` without a matching
    ``export.json`` (an export that was interrupted or damaged, or one of a checkpoint since saved again) is
    replaced."""
    digest = _verified_checkpoint(ckpt)
    out = ckpt / "hf"
    if export_complete(ckpt, digest):
        return out
    with file_lock(ckpt / ".hf.lock"):
        if export_complete(ckpt, digest):  # exported by another evaluation while this one waited
            return out
        for stale in ckpt.glob(".hf.*.tmp"):  # left by an export that was killed (only the lock holder writes)
            shutil.rmtree(stale, ignore_errors=True)
        if out.exists():
            log.warning(f"{out} is an incomplete, damaged or stale export (interrupted, or the checkpoint was saved "
                        "again); exporting the checkpoint again")
        staging = ckpt / f".hf.{os.getpid()}.tmp"
        step, tokens = _checkpoint_trained(ckpt)
        _write_export(ckpt, run_dir, staging / "hf", {"step": step, "tokens": tokens, "checkpoint": ckpt.name,
                                                      "manifest_sha256": digest})
        if out.exists():
            os.replace(out, staging / "old")
        os.replace(staging / "hf", out)
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _checkpoint_trained(ckpt: Path) -> tuple[int | None, int | None]:
    """``(step, tokens seen)`` of a verified checkpoint, from its ``train_state.json`` (``None`` where missing)."""
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except (OSError, ValueError):
        return None, None
    return state.get("step"), state.get("tokens_seen")


def _write_export(ckpt: Path, run_dir: Path, out: Path, record: dict[str, Any]) -> None:
    """Build the run's model, load the checkpoint's full weights and write a Hugging Face export to ``out`` with
    its ``export.json`` (``record`` and every file's size and SHA-256)."""
    from accelerate import Accelerator
    from omegaconf import OmegaConf

    from data import load_tokenizer, read_meta
    from models import build_model
    from trainer.checkpoint import export_hf
    from trainer.config import TrainConfig, build_model_config

    weights = [p for p in (ckpt / "pytorch_model.bin", ckpt / "model.safetensors") if p.is_file()]
    if not weights:
        raise FileNotFoundError(f"{ckpt} holds no full model weights (pytorch_model.bin); an FSDP checkpoint is "
                                "sharded: export it by resuming the run with trainer.max_steps=<its step> resume=force")
    # the model's part of the run config (the training budget is not re-validated here)
    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(TrainConfig), _run_config(run_dir)))
    shard_dir = Path(cfg.data.prepare.get("out_dir") or "")
    tok_name = read_meta(shard_dir)["tokenizer"]["name"] if (shard_dir / "meta.json").is_file() else \
        cfg.data.prepare.get("tokenizer", "mistral-v1")
    tokenizer = load_tokenizer(tok_name)
    model = build_model(build_model_config(cfg, tokenizer.vocab_size))
    if weights[0].suffix == ".bin":
        state = load_pickle(weights[0])
    else:
        from safetensors.torch import load_file

        state = load_file(weights[0])
    model.load_state_dict(state)
    log.info(f"exporting {ckpt} to {ckpt / 'hf'}")
    export_hf(Accelerator(cpu=True), model, tokenizer, out, record)


def _verified_export(hf_dir: Path, run_dir: Path | None) -> tuple[int | None, int | None] | None:
    """``(step, tokens)`` of an export that passes its ``export.json`` (every file's size and SHA-256), as a
    checkpoint passes its manifest; ``None`` for an export without one (a bare Hugging Face model, or a run export
    from before exports carried one, accepted with a warning only when the run has no checkpoint to match it to).
    A run's export older than the run's newest checkpoint (its export was interrupted or failed), or damaged, is
    refused in one line (``CheckpointError``)."""
    newest = Checkpointer(run_dir / "checkpoints", 1).latest() if run_dir is not None else None
    elsewhere = f", or evaluate its newest checkpoint: model={newest}" if newest is not None else ""
    record = export_record(hf_dir)
    if record is None:
        if newest is not None:
            raise CheckpointError(f"{hf_dir} has no {EXPORT_MANIFEST}: its files cannot be verified nor matched to "
                                  f"a checkpoint (an interrupted export, or one from before exports carried one); "
                                  f"rerun the training command to export it again{elsewhere}")
        if run_dir is not None:
            warnings.warn(f"{hf_dir} has no {EXPORT_MANIFEST}: its files are not verified and its step is read "
                          f"from {run_dir / 'metrics.jsonl'}; rerun the training command to export it with one",
                          stacklevel=3)
        return None
    problem = verify(hf_dir, manifest=EXPORT_MANIFEST)
    if problem is not None:
        raise CheckpointError(f"the export {hf_dir} is damaged: {problem}; rerun the training command to export it "
                              f"again (the checkpoints are untouched){elsewhere}")
    step = record.get("step")
    newest_step = int(_STEP_DIR.match(newest.name).group(1)) if newest is not None else None
    if newest_step is not None and (not isinstance(step, int) or newest_step > step):
        raise CheckpointError(f"{hf_dir} holds the weights of step {step}, older than the run's newest checkpoint "
                              f"{newest.name} (the export after it was interrupted or failed, or training goes on); "
                              f"rerun the training command to export it again{elsewhere}")
    return step, record.get("tokens")


def resolve(path: str | Path) -> Target:
    """A run directory (uses ``hf/``), a Hugging Face export, or a checkpoint ``runs/<x>/checkpoints/step_N``
    (verified against its manifest and exported to ``<checkpoint>/hf`` first; results under
    ``runs/<x>/eval/step_N``). A checkpoint that fails its manifest is refused in one line (``CheckpointError``)."""
    p = Path(path).expanduser()
    if not p.exists():
        raise FileNotFoundError(f"model={path}: no such directory; pass a run directory (runs/<name>), its hf/ "
                                "export or a checkpoint runs/<name>/checkpoints/step_N")
    if _STEP_DIR.match(p.name) and p.parent.name == "checkpoints":
        run_dir = p.parent.parent
        hf_dir = _export_checkpoint(p, run_dir)
        return Target(hf_dir, run_dir, run_dir / "eval" / p.name, int(_STEP_DIR.match(p.name).group(1)),
                      _checkpoint_trained(p))
    if (p / "config.json").is_file():
        run_dir = p.parent if (p.parent / "config.yaml").is_file() else None
        return Target(p, run_dir, (run_dir or p) / "eval", trained=_verified_export(p, run_dir))
    if (p / "config.yaml").is_file():
        if not (p / "hf" / "config.json").is_file():
            raise FileNotFoundError(f"model={path}: the run has no hf/ export yet (training unfinished?); finish "
                                    f"it, or pass a checkpoint: {p}/checkpoints/step_N")
        return Target(p / "hf", p, p / "eval", trained=_verified_export(p / "hf", p))
    raise FileNotFoundError(f"model={path} is neither a run directory (config.yaml), a Hugging Face export "
                            "(config.json) nor a checkpoint (checkpoints/step_N)")


def training_context(target: Target) -> int:
    """The run's training sequence length (``data.seq_len``), else the paper's 4096."""
    seq_len = _run_config(target.run_dir).get("data", {}).get("seq_len")
    return int(seq_len) if seq_len else DEFAULT_MAX_LENGTH


def full_attention_limit(model_config: Any, target: Target) -> int | None:
    """The longest context a model with a full-attention layer was trained on (``None`` when every layer is
    recurrent or sliding-window: those run at any length)."""
    codes = getattr(model_config, "layer_codes", "")
    kwargs = getattr(model_config, "mixer_kwargs", {}) or {}
    full = "A" in codes or (getattr(model_config, "mixer", None) == "attn" and "R" in codes
                            and kwargs.get("window", getattr(model_config, "window", None)) is None)
    return training_context(target) if full else None


def check_context(length: int, limit: int | None, what: str) -> None:
    """Refuse a ``length``-token context beyond a full-attention model's trained ``limit``."""
    if limit is not None and length > limit:
        raise ValueError(f"{what} needs {length} tokens but this full-attention model was trained on {limit}; "
                         f"drop the longer cells (e.g. ruler.lengths) or set max_length<={limit}")


def _last_metrics(run_dir: Path) -> dict[str, Any]:
    """The run's last training record in ``metrics.jsonl`` (``{}`` without one); a torn last line is dropped with a
    warning, an unreadable line before it is refused in one line."""
    path = run_dir / "metrics.jsonl"
    rows = read_jsonl(path) if path.is_file() else []
    return next((r for r in reversed(rows) if isinstance(r, dict) and "tokens" in r), {})


def model_metadata(target: Target, model: Any) -> dict[str, Any]:
    """The ``model`` block of a results file: paths, mixer, size, pattern, options, parameter counts, tokens
    trained, training seed, step and the code's commit (see :func:`_commit`)."""
    from models import parameter_counts

    cfg = _run_config(target.run_dir)
    mc = model.config
    try:
        total, non_embedding = parameter_counts(mc)
    except (TypeError, AttributeError, ValueError):
        total, non_embedding = sum(p.numel() for p in model.parameters()), None
    if target.trained is not None:  # the weights' own record, never the run's newest (it may have gone on)
        last = {"step": target.trained[0], "tokens": target.trained[1]}
    else:
        last = _last_metrics(target.run_dir) if target.run_dir is not None else {}
    mixer_cfg = cfg.get("mixer", {})
    return {
        "run_dir": str(target.run_dir) if target.run_dir else None, "hf_dir": str(target.hf_dir),
        "name": cfg.get("name") or target.hf_dir.parent.name, "mixer": getattr(mc, "mixer", None),
        "size": cfg.get("model", {}).get("size"), "pattern": getattr(mc, "pattern", None),
        "mixer_options": {k: mixer_cfg.get(k) for k in ("mu", "noise", "alpha_param")} if mixer_cfg else
        dict(getattr(mc, "mixer_kwargs", {}) or {}),
        "parameters": int(total), "non_embedding_parameters": None if non_embedding is None else int(non_embedding),
        "tokens_trained": last.get("tokens"), "seed": cfg.get("seed"),
        "step": target.step if target.step is not None else last.get("step"),
        **_commit(cfg),
    }


def _commit(run_cfg: dict[str, Any]) -> dict[str, str | None]:
    """``git_commit``: the commit the run's config records, else this checkout's (training records none today);
    ``git_commit_source`` says which (``run`` / ``evaluation checkout``; ``None`` outside a git checkout)."""
    if run_cfg.get("git_commit"):
        return {"git_commit": run_cfg["git_commit"], "git_commit_source": "run"}
    commit = git_commit()
    return {"git_commit": commit, "git_commit_source": "evaluation checkout" if commit else None}
