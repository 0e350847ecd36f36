"""The GPU tools' host-side logic: the Diagonal memory variants of bench.mixer_throughput and the stage time
limits of bench/device.sh (a stage that ignores SIGTERM, as train.py does, is still stopped in time)."""
from __future__ import annotations

import re
import subprocess
import time
from pathlib import Path

import pytest

from bench.mixer_throughput import variant
from kdn import triton_ops

ROOT = Path(__file__).resolve().parents[1]


def test_variant_sets_and_restores_the_memory_settings() -> None:
    before = (triton_ops.DIAG_MEMORY, triton_ops.DPLR_CHUNK)
    with variant("kdn_diag@c64") as base:
        assert base == "kdn_diag"
        assert (triton_ops.DIAG_MEMORY, triton_ops.DPLR_CHUNK) == ("dplr", 64)
    with variant("kdn_diag@dplr"):
        assert triton_ops.DIAG_MEMORY == "dplr"
    with variant("kdn_iso") as base:
        assert base == "kdn_iso"
    assert (triton_ops.DIAG_MEMORY, triton_ops.DPLR_CHUNK) == before
    with pytest.raises(ValueError, match="unknown variant 'x64'"), variant("kdn_diag@x64"):
        pass


def _run_stages(script: str, env: dict[str, str]) -> tuple[str, float]:
    src = (ROOT / "bench" / "device.sh").read_text()
    func = re.search(r"^run_stage\(\) \{.*?^\}", src, re.S | re.M).group(0)
    start = time.monotonic()
    proc = subprocess.run(["bash", "-c", f"LOG=/dev/null; START=$SECONDS; rc=0\n{func}\n{script}\necho rc=$rc"],
                          env=env, capture_output=True, text=True, timeout=60)
    return proc.stdout, time.monotonic() - start


def test_device_stages_stay_inside_the_call() -> None:
    env = {"PATH": "/usr/bin:/bin", "KILL_S": "1"}
    # a stage that ignores SIGTERM is killed KILL_S seconds after its limit
    out, took = _run_stages("run_stage stubborn bash -c 'trap \"\" TERM; sleep 30'",
                            env | {"STAGE_S": "2", "DEVICE_S": "100"})
    assert "limit 2 s)" in out and "=== stubborn exit 137" in out and "rc=137" in out, out
    assert took < 8, took
    # a stage's limit is cut to what DEVICE_S leaves (minus KILL_S and 5 s for the tarball)
    out, _ = _run_stages("run_stage quick true", env | {"STAGE_S": "100", "DEVICE_S": "17"})
    assert "=== quick (" in out and "limit 11 s)" in out and "=== quick exit 0" in out and "rc=0" in out, out
    # and skipped when under 10 s would be left
    out, _ = _run_stages("run_stage late true", env | {"STAGE_S": "100", "DEVICE_S": "15"})
    assert "=== late skipped: DEVICE_S reached" in out and "rc=124" in out, out
