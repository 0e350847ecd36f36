"""One run directory is one experiment: its default name, its config fingerprint, and its lock.

- ``run_overrides()`` (the ``${run_overrides:}`` resolver in ``conf/config.yaml``) appends the command line's
  experiment-changing overrides to the default name, so ``mixer.mu=1`` and ``mixer.mu=dk`` get different
  directories. Overrides of the keys in ``RESUMABLE_KEYS`` (and the group choices already in the name) are left out;
  values are written as the config schema reads them (``optim.lr=1e-3`` and ``optim.lr=0.001`` name one run).
- ``fingerprint(config)`` hashes the resolved config without ``RESUMABLE_KEYS``; ``check_fingerprint`` refuses a
  resume whose config differs from the one stored in the run directory (``fingerprint.json``), naming the keys.
- ``RunLock`` keeps a second process out of a run directory (``run.lock``: pid, host, SLURM job id).
- ``earlier_training`` and ``set_aside_records``: a run directory whose training left records but no intact
  checkpoint is started over only on request (``resume=restart``), its records kept under another name.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import socket
import time
import uuid
from pathlib import Path
from types import TracebackType
from typing import Any

from common import write_text_atomic

log = logging.getLogger("train")

FINGERPRINT_FILE = "fingerprint.json"
LOCK_FILE = "run.lock"
HYDRA_SUBDIR = ".hydra"  # Hydra's composed config and the command's overrides, as Hydra names the folder

# Keys that may change between a run and its resume: bookkeeping, logging, and how (not what) it computes.
# A key covers its sub-keys ("logging" covers logging.wandb.mode). trainer.max_steps is not one: it sets the
# learning-rate schedule of the steps to come.
RESUMABLE_KEYS = (
    "name", "runs_root", "run_dir", "resume", "logging",
    "trainer.stop_after", "trainer.eval_every", "trainer.ckpt_every", "trainer.keep_last",
    "trainer.export", "trainer.preempt_signals", "trainer.peak_flops", "trainer.reshard",
    "trainer.check_weights_every", "trainer.compile", "trainer.recompute_states",
    "data.auto_prepare", "data.num_workers", "data.prepare.num_workers", "data.prepare.progress",
    "data.prepare.overwrite",
)
# Keys added after runs were recorded, with the value those runs had: dropped from the identity at that value, so
# the runs keep their fingerprint and resume.
IMPLICIT_DEFAULTS = {"model.init": "fla"}
_NAMED_GROUPS = ("model", "mixer", "backbone")  # their choices are already in the default name
_MAX_SUFFIX = 120  # characters; a longer suffix is cut and ends with a hash of the whole


class RunDirError(RuntimeError):
    """The run directory belongs to another experiment or another process; the message is one line."""


def _covered(key: str, keys: tuple[str, ...]) -> bool:
    return any(key == k or key.startswith(k + ".") for k in keys)


def _text(value: Any) -> str:
    """A config value as a name writes it: ``0.001``, ``30``, ``true``, ``null``, ``[0.8,0.9]``."""
    if isinstance(value, bool):
        return str(value).lower()
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(_text(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_text(v)}" for k, v in value.items()) + "}"
    return repr(value) if isinstance(value, float) else str(value)


def normalise(item: str, schema: type | None) -> str:
    """``"key=value"`` with the value as Hydra parses it and ``schema`` (a structured-config dataclass) types it:
    ``optim.lr=1e-3`` -> ``optim.lr=0.001``. A key outside the schema, a sweep or a value it refuses keeps its text."""
    if schema is None or "=" not in item:
        return item
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    try:
        override = OverridesParser.create().parse_override(item)
        if override.is_sweep_override() or override.is_delete():
            return item
        typed = OmegaConf.structured(schema)
        OmegaConf.update(typed, override.key_or_group, override.value(), merge=True)
        value = OmegaConf.select(typed, override.key_or_group, throw_on_missing=True)
    except (HydraException, OmegaConfBaseException, ValueError):
        return item
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value)
    return f"{override.key_or_group}={_text(value)}"


def name_suffix(overrides: list[str], schema: type | None = None) -> str:
    """``"_k1=v1,k2=v2"`` from Hydra task overrides (sorted; resumable keys and named groups dropped; values
    normalised by ``schema``, see ``normalise``), or ``""``."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in _NAMED_GROUPS or _covered(key, RESUMABLE_KEYS) or key.startswith(("hydra.", "hydra/")):
            continue
        kept.append(re.sub(r"[^A-Za-z0-9._=+,-]", "_", normalise(item.lstrip("+~"), schema)))
    if not kept:
        return ""
    suffix = ",".join(sorted(kept))
    if len(suffix) > _MAX_SUFFIX:
        suffix = suffix[:_MAX_SUFFIX - 9] + "-" + hashlib.sha256(suffix.encode()).hexdigest()[:8]
    return "_" + suffix


def run_overrides(schema: type | None = None) -> str:
    """The ``${run_overrides:}`` resolver: ``name_suffix`` of the running Hydra job's overrides ("" outside one)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return ""
    return name_suffix(list(HydraConfig.get().overrides.task), schema)


def flatten(config: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested dicts to dotted keys: ``{"a": {"b": 1}} -> {"a.b": 1}`` (lists stay values)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        full = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            out.update(flatten(value, full + "."))
        else:
            out[full] = value
    return out


def _canonical(config: dict[str, Any]) -> dict[str, Any]:
    """``config`` with its mixer section as that mixer's whole config (``trainer.mixer.canonical_mixer``), so a run
    recorded in an older form of the section, or with an option at its default left out, is the same experiment."""
    from trainer.mixer import ConfigError, canonical_mixer

    if not isinstance(config.get("mixer"), dict):
        return config
    try:
        return {**config, "mixer": canonical_mixer(config["mixer"], legacy=True)}
    except ConfigError:
        return config


def identity(config: dict[str, Any]) -> dict[str, Any]:
    """The flattened config without ``RESUMABLE_KEYS``: what makes the experiment."""
    return {k: v for k, v in sorted(flatten(_canonical(config)).items())
            if not _covered(k, RESUMABLE_KEYS) and not (k in IMPLICIT_DEFAULTS and v == IMPLICIT_DEFAULTS[k])}


def fingerprint(config: dict[str, Any]) -> str:
    """SHA-256 of ``identity(config)`` as canonical JSON."""
    return hashlib.sha256(json.dumps(identity(config), sort_keys=True, default=str).encode()).hexdigest()


def differences(old: dict[str, Any], new: dict[str, Any]) -> dict[str, list[Any]]:
    """``{key: [old, new]}`` for every identity key whose value differs (a missing key reads ``None``)."""
    a, b = identity(old), identity(new)
    return {k: [a.get(k), b.get(k)] for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)}


def stored_config(run_dir: Path) -> dict[str, Any] | None:
    """The config recorded in ``run_dir/fingerprint.json``, or ``None`` when there is none."""
    path = run_dir / FINGERPRINT_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())["config"]
    except (json.JSONDecodeError, KeyError) as e:
        raise RunDirError(f"{path} is unreadable ({e}); delete it to adopt this run's config") from None


def check_fingerprint(run_dir: Path, config: dict[str, Any], force: bool) -> dict[str, list[Any]]:
    """Compare ``config`` with the one stored in ``run_dir``; returns the differences (empty when equal).

    Raises ``RunDirError`` listing the differing keys unless ``force``."""
    old = stored_config(run_dir)
    if old is None:
        return {}
    diff = differences(old, config)
    if diff and not force:
        shown = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in list(diff.items())[:6])
        more = f" (+{len(diff) - 6} more)" if len(diff) > 6 else ""
        raise RunDirError(
            f"{run_dir} holds another experiment ({shown}{more}); start a new run with name=<new name>, or add "
            "resume=force to continue this run with the new settings")
    return diff


def store_fingerprint(run_dir: Path, config: dict[str, Any]) -> None:
    """Write ``fingerprint.json`` (the hash and the config it covers) through a temp file and a rename."""
    write_text_atomic(run_dir / FINGERPRINT_FILE,
                      json.dumps({"fingerprint": fingerprint(config), "config": config}, indent=1, default=str))


def earlier_training(run_dir: Path) -> str:
    """What in ``run_dir`` shows that training ran there (metrics records, checkpoints set aside as damaged), as
    a phrase for a message; ``""`` when nothing does."""
    found = []
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file() and metrics.stat().st_size:
        found.append(f"records in {metrics.name}")
    ckpts = run_dir / "checkpoints"
    damaged = sorted(p.name for p in ckpts.glob("step_*.corrupt")) if ckpts.is_dir() else []
    if damaged:
        found.append(f"checkpoints set aside as damaged: {', '.join(damaged[:3])}"
                     + (f" (+{len(damaged) - 3} more)" if len(damaged) > 3 else ""))
    return "; ".join(found)


def set_aside_records(run_dir: Path) -> list[Path]:
    """Rename the records of an earlier start (``metrics.jsonl``, the ``hf`` export) to ``<stem>.<UTC time>``
    names that nothing overwrites; returns the new paths."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    moved = []
    for name in ("metrics.jsonl", "hf"):
        path = run_dir / name
        if not path.exists():
            continue
        stem, suffix = (path.stem, path.suffix) if path.is_file() else (path.name, "")
        target, n = run_dir / f"{stem}.{stamp}{suffix}", 1
        while target.exists():
            target, n = run_dir / f"{stem}.{stamp}-{n}{suffix}", n + 1
        os.replace(path, target)
        moved.append(target)
    return moved


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


class RunLock:
    """Context manager holding ``<run_dir>/run.lock`` (JSON: pid, host, SLURM job id, a token).

    A lock of a dead process on this host, or of an earlier run of the same SLURM job (a requeue), is stale:
    it is broken with a warning. Any other lock refuses the run with a one-line ``RunDirError``."""

    def __init__(self, run_dir: Path | str) -> None:
        self.path = Path(run_dir) / LOCK_FILE
        self.me = {"pid": os.getpid(), "host": socket.gethostname(), "job": os.environ.get("SLURM_JOB_ID"),
                   "token": uuid.uuid4().hex}
        self.held = False

    def _holder(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, OSError):
            return {}  # unreadable (an empty or damaged file): no live holder can be named

    def _stale(self, holder: dict[str, Any]) -> bool:
        if not holder:
            return True
        if holder.get("job") and holder.get("job") == self.me["job"]:
            return True
        return holder.get("host") == self.me["host"] and not _pid_alive(int(holder.get("pid", -1)))

    def acquire(self) -> None:
        """Take the lock or raise ``RunDirError``. The lock file appears whole (a hard link of a written temp
        file), so a reader never sees a half-written one from a live process."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        mine = self.path.with_name(f".{LOCK_FILE}.{self.me['token']}")
        mine.write_text(json.dumps(self.me))
        try:
            for _ in range(3):
                try:
                    os.link(mine, self.path)
                except FileExistsError:
                    holder = self._holder()
                    if holder is None:
                        continue  # released meanwhile
                    if not self._stale(holder):
                        raise RunDirError(
                            f"{self.path.parent} is in use by pid {holder.get('pid')} on {holder.get('host')} "
                            f"(lock {self.path}); wait for that run to end, use another name=, or delete the lock "
                            "if that process is gone") from None
                    log.warning(f"breaking the stale lock {self.path} of pid {holder.get('pid')} on "
                                f"{holder.get('host')} (that process is gone)")
                    self._break(holder)
                    continue
                self.held = True
                return
        finally:
            mine.unlink()
        raise RunDirError(f"could not take the lock {self.path}: other processes keep taking it; run one at a time")

    def _break(self, holder: dict[str, Any]) -> None:
        """Move the stale lock of ``holder`` away; a lock that another process took meanwhile is put back."""
        aside = self.path.with_name(f".{LOCK_FILE}.{self.me['token']}.stale")
        try:
            os.replace(self.path, aside)
        except FileNotFoundError:
            return  # another process broke it first; race for the new lock
        try:
            moved = json.loads(aside.read_text())
        except (json.JSONDecodeError, OSError):
            moved = {}
        if moved != holder:  # a fresh lock: give it back
            try:
                os.link(aside, self.path)
            except FileExistsError:
                pass
        aside.unlink()

    def release(self) -> None:
        """Remove the lock file if it is still this process's."""
        if self.held and (self._holder() or {}).get("token") == self.me["token"]:
            self.path.unlink()
        self.held = False

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.release()
