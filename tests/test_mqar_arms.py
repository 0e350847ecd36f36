"""bench/mqar_arms.sh on the CPU: its arms run side by side into one folder, each with its own results file and
job names, and the shared settings reach every arm unless an extra argument overrides them."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from conftest import timeout_s

ROOT = Path(__file__).resolve().parents[1]
TINY = ["preset=cpu", "widths=32", "seeds=0", "epochs=1", "lrs=1e-2", "train_examples=160", "valid_examples=32",
        "test_examples=32", "head_dim=16"]


def test_two_arms_run_side_by_side_into_one_folder(tmp_path: Path) -> None:
    out = tmp_path / "arms"
    env = {**os.environ, "ARMS": "fla bf16 kda\nauthors fp32 kdn_diag", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(["bash", "bench/mqar_arms.sh", str(out), *TINY], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout_s(300))
    assert proc.returncode == 0, proc.stdout + "".join(p.read_text()[-2000:] for p in (out / "logs").glob("*.log"))
    assert proc.stdout.count("arm init=") == 2 and proc.stdout.strip().endswith("arms done (exit 0)")
    assert sorted(p.name for p in (out / "jobs").glob("*.json")) == [
        "kda_d32_lr0.01_s0.json", "kdn_diag_d32_lr0.01_s0_init-authors_fp32.json"]
    default = json.loads((out / "mqar.json").read_text())["config"]
    arm = json.loads((out / "mqar_init-authors_fp32.json").read_text())["config"]
    assert (default["init"], default["precision"], default["mixers"]) == ("fla", "bf16", ["kda"])
    assert (arm["init"], arm["precision"], arm["mixers"]) == ("authors", "fp32", ["kdn_diag"])
    assert arm["widths"] == default["widths"] == [32] and arm["epochs"] == 1  # the extra arguments win
    assert sorted(p.name for p in (out / "logs").iterdir()) == ["authors_fp32_kdn_diag.log", "fla_bf16_kda.log"]


def test_a_failing_arm_fails_the_script(tmp_path: Path) -> None:
    env = {**os.environ, "ARMS": "fla bf16 kda\nfla fp64 kdn_diag", "PYTHONPATH": str(ROOT)}
    # train=false: the sound arm succeeds without training (it reports an empty grid); the other fails on its value
    proc = subprocess.run(["bash", "bench/mqar_arms.sh", str(tmp_path / "arms"), *TINY, "train=false"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout_s(300))
    assert (tmp_path / "arms" / "mqar.json").is_file()  # the sound arm's report
    assert proc.returncode == 1 and proc.stdout.strip().endswith("arms done (exit 1)")
    assert "precision" in (tmp_path / "arms" / "logs" / "fla_fp64_kdn_diag.log").read_text()
