"""The one atomic write and the one JSON-lines reader of the project.

``write_atomic(path, data)`` leaves ``path`` holding either its old content or the whole new one, whatever happens
to the writer (a crash, a kill, a full disk): the data goes to a temp file in the same folder, named uniquely for
this process and call, which is fsynced, renamed over ``path``, and the folder fsynced so that the rename survives a
power loss. On any error the temp file is removed and ``path`` is left as it was.
"""
from __future__ import annotations

import json
import os
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any


def temp_name(path: Path) -> Path:
    """``<name>.<pid>.<random>.tmp`` beside ``path``: no two writers (processes or threads) share one."""
    return path.with_name(f"{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path | str, data: bytes | str) -> None:
    """Write ``data`` (text is UTF-8 encoded) to ``path``, its folder made if needed: temp file in the same folder,
    fsync, rename, fsync of the folder. A failed write (a full disk, a quota) removes the temp file and raises the
    ``OSError`` with ``path`` as its filename, also when the system named no file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = data.encode("utf-8") if isinstance(data, str) else data
    tmp = temp_name(path)
    try:
        with open(tmp, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if isinstance(e, OSError):
            raise OSError(e.errno, e.strerror or str(e), str(path)) from e
        raise
    _fsync_dir(path.parent)


def write_text_atomic(path: Path | str, text: str) -> None:
    """:func:`write_atomic` of a string."""
    write_atomic(path, text)


def write_json_atomic(path: Path | str, obj: Any) -> None:
    """:func:`write_atomic` of ``obj`` as indented JSON."""
    write_atomic(path, json.dumps(obj, indent=1))


def _warn(path: Path, line: int, text: str) -> None:
    warnings.warn(f"{path}:{line}: dropping a torn last line ({len(text)} characters; the writer stopped while "
                  "writing it)", stacklevel=3)


def read_jsonl(path: Path | str, on_torn: Callable[[Path, int, str], None] | None = _warn) -> list[Any]:
    """The records of a JSON-lines file (blank lines skipped). An unreadable last line (a writer that stopped
    mid-line) is passed to ``on_torn(path, line number, text)`` and dropped (a warning by default; ``None``: it is
    refused like any other); an unreadable line before it raises a one-line ``ValueError`` naming the file and
    line."""
    path = Path(path)
    lines = path.read_text().splitlines()
    rows = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines) and on_torn is not None:
                on_torn(path, i, line)
                break
            raise ValueError(f"{path}:{i} is not JSON ({e.msg}); repair or remove that line") from None
    return rows
