"""The one atomic write (``common.write_atomic``): a writer killed with SIGKILL mid-write (a real process, paused
by a fifo at the point named) leaves the target holding either its old content or the whole new one; a write that
fails cleanly (a full disk) leaves no temp file. And the one JSON-lines reader: a torn last line is dropped, an
unreadable line before it is refused in one line naming the file and line."""
from __future__ import annotations

import errno
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import timeout_s

import common.io
from common import read_jsonl, write_atomic

ROOT = Path(__file__).resolve().parents[1]
NEW = 48 << 20  # bytes of the new content: a large payload, many write calls deep
# pauses the writer at `stage` (after the data is written, before its fsync; or just after the rename) until killed
WRITER = """
import os, sys
from pathlib import Path
import common.io
target, stage, ready = sys.argv[1:4]
real_fsync, real_replace = os.fsync, os.replace
def pause():
    with open(ready, "w") as f:
        f.write(stage)
    open(ready + ".never").read()  # a fifo nobody writes: blocks until the kill
def fsync(fd):
    if stage == "data":
        pause()
    real_fsync(fd)
def replace(a, b):
    real_replace(a, b)
    if stage == "renamed":
        pause()
common.io.os.fsync, common.io.os.replace = fsync, replace
common.io.write_atomic(Path(target), b"N" * int(sys.argv[4]))
"""


def _killed_at(tmp_path: Path, stage: str) -> Path:
    target = tmp_path / "out.bin"
    target.write_bytes(b"old content\n")
    ready = tmp_path / "ready"
    os.mkfifo(ready)
    os.mkfifo(tmp_path / "ready.never")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", WRITER, str(target), stage, str(ready), str(NEW)], env=env)
    try:
        fd = os.open(ready, os.O_RDONLY | os.O_NONBLOCK)
        try:
            seen = b""
            while not seen:  # a fifo with no writer yet is not readable: wait for the writer to say where it is
                readable, _, _ = select.select([fd], [], [], timeout_s(120))
                assert readable, "the writer never reached its pause"
                seen = os.read(fd, 64)
            assert seen == stage.encode()
        finally:
            os.close(fd)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout_s(60))
    assert proc.returncode == -signal.SIGKILL
    return target


def test_a_writer_killed_before_its_rename_leaves_the_old_content(tmp_path: Path) -> None:
    target = _killed_at(tmp_path, "data")
    assert target.read_bytes() == b"old content\n"
    (tmp,) = tmp_path.glob("out.bin.*.tmp")  # the killed writer's data, under a name of its own
    assert tmp.stat().st_size == NEW


def test_a_writer_killed_after_its_rename_leaves_the_whole_new_content(tmp_path: Path) -> None:
    target = _killed_at(tmp_path, "renamed")
    assert target.stat().st_size == NEW and target.read_bytes() == b"N" * NEW
    assert not list(tmp_path.glob("out.bin.*.tmp"))


def test_a_write_that_fails_removes_its_temp_file_and_keeps_the_target(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / "out.json"
    write_atomic(target, "old\n")

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(common.io.os, "fsync", full)
    with pytest.raises(OSError) as err:
        write_atomic(target, "new\n" * 1000)
    assert err.value.errno == errno.ENOSPC and err.value.filename == str(target)
    assert target.read_text() == "old\n" and sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_two_writers_of_one_process_never_share_a_temp_file(tmp_path: Path) -> None:
    names = {common.io.temp_name(tmp_path / "x.json") for _ in range(100)}
    assert len(names) == 100 and all(n.parent == tmp_path and str(os.getpid()) in n.name for n in names)


def test_read_jsonl_drops_a_torn_last_line_and_refuses_one_before_it(tmp_path: Path) -> None:
    path = tmp_path / "m.jsonl"
    path.write_text('{"step": 1}\n\n{"step": 2}\n{"step": 3, "lo')
    torn: list[tuple[int, str]] = []
    assert read_jsonl(path, on_torn=lambda p, i, text: torn.append((i, text))) == [{"step": 1}, {"step": 2}]
    assert torn == [(4, '{"step": 3, "lo')]
    with pytest.raises(ValueError, match=rf"^{path}:4 is not JSON \(.*\); repair or remove that line$"):
        read_jsonl(path, on_torn=None)
    path.write_text('{"step": 1}\n{"st\n{"step": 3}\n')
    with pytest.raises(ValueError, match=rf"^{path}:2 is not JSON"):
        read_jsonl(path)
