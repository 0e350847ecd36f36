"""The job ledger of a run directory (``submit/jobs.jsonl``: every job id submitted for it) and SLURM's state of
those jobs.

The ledger is rewritten whole through a temp file and a rename, so a reader never sees a torn record; the sweep
asks the scheduler about every recorded job before it submits, so that a run never holds two live jobs (a job it
cannot ask about, :data:`UNKNOWN`, stops the sweep).
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

LEDGER = Path("submit") / "jobs.jsonl"
# SLURM states of a job that still holds or waits for resources; any other state is over
ACTIVE = {"PENDING": "pending", "CONFIGURING": "pending", "REQUEUED": "pending", "REQUEUE_HOLD": "pending",
          "REQUEUE_FED": "pending", "RESIZING": "running", "RUNNING": "running", "COMPLETING": "running",
          "SUSPENDED": "running", "STAGE_OUT": "running", "SIGNALING": "running"}


def recorded_jobs(run_dir: Path, kind: str | None = None) -> list[dict]:
    """The ledger's records ``{"job_id", "kind", ...}``, oldest first; only those of ``kind`` when given."""
    path = run_dir / LEDGER
    if not path.is_file():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and "job_id" in rec and (kind is None or rec.get("kind") == kind):
            records.append(rec)
    return records


def record_job(run_dir: Path, record: dict) -> None:
    """Append ``record`` to the ledger: the whole file is written to a temp file, then renamed over it."""
    path = run_dir / LEDGER
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps(r) for r in recorded_jobs(run_dir)] + [json.dumps(record)]
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(lines) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


QUERY_TIMEOUT_S = 30.0
"""How long ``squeue`` or ``sacct`` may take to answer about one job before it counts as not answering."""
UNKNOWN = "unknown"
"""The state of a job that SLURM could not be asked about (``squeue`` missing, failing or not answering, and nothing
from ``sacct``): it may still be queued or running, so a sweep does not resubmit its run (``slurm.submit``)."""


def _ask(cmd: list[str]) -> subprocess.CompletedProcess | None:
    """``cmd``'s result, or None when it is not on PATH, cannot start or does not answer within
    :data:`QUERY_TIMEOUT_S`."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=QUERY_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired):
        return None


def scheduler_state(job_id: str) -> str | None:
    """SLURM's state of ``job_id``: ``squeue``'s for a job in the queue, else ``sacct``'s; ``None`` when ``squeue``
    answered that the job is not queued and ``sacct`` holds no record of it (it is over); :data:`UNKNOWN` when
    neither could tell (``squeue`` missing, failing or not answering, and nothing from ``sacct``)."""
    queue = _ask(["squeue", "-h", "-j", job_id, "-o", "%T"])
    if queue is not None and queue.returncode == 0 and queue.stdout.strip():
        return queue.stdout.split()[0]
    # squeue answers with nothing, or for a job it no longer holds with "Invalid job id specified" and status 1
    not_queued = queue is not None and (queue.returncode == 0 or "Invalid job id" in queue.stderr)
    acct = _ask(["sacct", "-n", "-X", "-j", job_id, "-o", "State"])
    if acct is not None and acct.returncode == 0 and acct.stdout.strip():
        return acct.stdout.split()[0].rstrip("+")
    return None if not_queued else UNKNOWN


def job_states(run_dir: Path, kind: str | None = None) -> list[tuple[str, str | None]]:
    """``(job id, :func:`scheduler_state`)`` of every recorded job of ``run_dir`` (of ``kind`` when given)."""
    return [(str(r["job_id"]), scheduler_state(str(r["job_id"]))) for r in recorded_jobs(run_dir, kind)]


def active_jobs(states: list[tuple[str, str | None]]) -> list[tuple[str, str]]:
    """The ``(job id, state)`` of ``states`` that are queued or running."""
    return [(j, s) for j, s in states if s in ACTIVE]
