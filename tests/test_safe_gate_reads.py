"""The safe-gate check's read counts, on the CPU: counted only inside a ``count_safe_gate_reads`` scope, in every
scope around the read and in no other thread's, and the step profiler reports the reads of its profiled steps
alone."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")


def _read(ok: bool, n: int = 1) -> None:
    from kdn.ops.triton.safe_gate import SafeGate

    for _ in range(n):
        bool(SafeGate(torch.tensor(ok)))


def test_reads_are_counted_in_the_scopes_around_them() -> None:
    from kdn.ops.triton import count_safe_gate_reads

    _read(True)  # outside every scope: counted nowhere
    with count_safe_gate_reads() as outer:
        _read(True, 2)
        with count_safe_gate_reads() as inner:
            _read(False, 3)
        _read(True)
        worker = threading.Thread(target=_read, args=(False, 5))  # a context of its own: outside these scopes
        worker.start()
        worker.join()
    _read(False)
    assert dict(inner) == {False: 3}
    assert dict(outer) == {True: 3, False: 3}
    with count_safe_gate_reads() as later:
        _read(True)
    assert dict(later) == {True: 1}


def test_the_profiler_reports_the_reads_of_its_steps(tmp_path: Path) -> None:
    from kdn.ops.triton.safe_gate import _READS
    from trainer.profiling import StepProfiler

    prof = StepProfiler(tmp_path, start=1, steps=2, enabled=True, device=torch.device("cpu"))
    _read(True, 4)  # before the window
    for step in range(4):
        prof.step_begins(step)
        _read(step % 2 == 0, step + 1)
        prof.step_ends(step + 1)
    assert _READS.get() == ()  # its scope closed with the window
    _read(False, 6)  # after it
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == [2, 3] and summary["safe_gate_reads"] == {"tensor_core": 3, "token_loop": 2}
