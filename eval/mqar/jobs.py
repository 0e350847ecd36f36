"""A grid's job records in one summary file, and back.

``python -m eval.mqar`` stores each finished job as ``out/jobs/<job>.json``. A grid kept in the repository holds its
jobs as one summary, ``out/jobs.json`` (``{"benchmark": "mqar_jobs", "jobs": {<job>: <record>}}``), which the queue's
timing model reads directly and which unpacks back into job files for a rerun to reuse.

``python -m eval.mqar.jobs pack FOLDER`` writes ``FOLDER/jobs.json`` from ``FOLDER/jobs/*.json``;
``python -m eval.mqar.jobs unpack SUMMARY JOBS_DIR`` writes each record as ``JOBS_DIR/<job>.json`` where none is.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from trainer.checkpoint import write_json_atomic
from trainer.rundir import write_text_atomic

SUMMARY = "jobs.json"
KIND = "mqar_jobs"


def load_summary(path: Path) -> dict[str, dict[str, Any]]:
    """The job records of a summary by job name; a one-line ``ValueError`` for a file that is not one."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"cannot read {path} as JSON ({err}); write it with python -m eval.mqar.jobs pack "
                         "FOLDER") from None
    if not isinstance(data, dict) or data.get("benchmark") != KIND or not isinstance(data.get("jobs"), dict):
        raise ValueError(f"{path} is not an MQAR job summary; write one with python -m eval.mqar.jobs pack FOLDER")
    return data["jobs"]


def job_records(folder: Path) -> dict[str, dict[str, Any]]:
    """Every stored job record of the grid folder ``folder`` by job name: its summary's, then its job files' (a job
    file replaces the summary's record of its name; an unreadable job file is skipped, as a rerun would retrain it)."""
    records = dict(load_summary(folder / SUMMARY)) if (folder / SUMMARY).is_file() else {}
    for path in sorted((folder / "jobs").glob("*.json")):
        try:
            records[path.stem] = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return records


def has_jobs(folder: Path) -> bool:
    """Whether ``folder`` holds a grid's jobs, as job files or as a summary."""
    return (folder / "jobs").is_dir() or (folder / SUMMARY).is_file()


def pack(folder: Path) -> Path:
    """Write ``folder/jobs.json`` from every job file and the summary already there; one job a line, so that a
    changed job is a one-line change. Returns its path."""
    records = job_records(folder)
    if not records:
        raise ValueError(f"{folder} has no job files under jobs/; pass the out folder of a python -m eval.mqar run")
    items = sorted(records.items())
    lines = ",\n".join(f"{json.dumps(name)}: {json.dumps(rec, sort_keys=True)}" for name, rec in items)
    path = folder / SUMMARY
    write_text_atomic(path, f'{{"benchmark": "{KIND}", "jobs": {{\n{lines}\n}}}}\n')
    return path


def unpack(summary: Path, jobs_dir: Path) -> int:
    """Write each record of ``summary`` as ``jobs_dir/<job>.json`` where that file does not exist yet (a job trained
    since is kept); returns how many were written."""
    written = 0
    for name, record in load_summary(summary).items():
        path = jobs_dir / f"{name}.json"
        if not path.exists():
            write_json_atomic(path, record)
            written += 1
    return written


def main(argv: list[str]) -> None:
    usage = "usage: python -m eval.mqar.jobs pack FOLDER | unpack SUMMARY.json JOBS_DIR"
    try:
        if len(argv) == 2 and argv[0] == "pack":
            print(f"wrote {pack(Path(argv[1]))}")
        elif len(argv) == 3 and argv[0] == "unpack":
            print(f"wrote {unpack(Path(argv[1]), Path(argv[2]))} job files into {argv[2]}")
        else:
            raise SystemExit(usage)
    except ValueError as err:
        raise SystemExit(f"error: {err}") from None


if __name__ == "__main__":
    main(sys.argv[1:])
