"""A preemption signal during train.py's start-up exits 75 (requeue), and slurm/train.sbatch requeues on it."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import timeout_s

from trainer.preemption import REQUEUE_EXIT_CODE

ROOT = Path(__file__).resolve().parents[1]


# train.py as ``python train.py`` runs it, with its first import of torch held until the test has sent the signal
# and closed stdin: the signal arrives during the imports however the two processes are scheduled
GATED = """
import runpy, sys


class Gate:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            print("importing torch", flush=True)
            sys.stdin.read()


sys.meta_path.insert(0, Gate())
sys.argv = ["train.py", *sys.argv[1:]]
runpy.run_path("train.py", run_name="__main__")
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_a_signal_during_the_imports_exits_75(sig: signal.Signals) -> None:
    # a bad key: a process that got past its imports would exit 1 with a config error instead
    env = {**os.environ, "WANDB_MODE": "disabled", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", GATED, "trainer.max_stepz=1"], cwd=ROOT, env=env,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    out, deadline = b"", time.monotonic() + timeout_s(60)
    while b"importing torch\n" not in out:
        ready = select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]
        chunk = os.read(proc.stdout.fileno(), 65536) if ready else b""
        if not chunk:
            proc.kill()
        assert chunk, f"train.py never imported torch: {(out + proc.communicate()[0])[-2000:]!r}"
        out += chunk
    proc.send_signal(sig)
    text = (out + proc.communicate(timeout=timeout_s(120))[0]).decode()
    assert proc.returncode == REQUEUE_EXIT_CODE, text[-2000:]
    assert "max_stepz" not in text


def _sbatch(tmp_path: Path, srun_body: str) -> tuple[int, str]:
    """Run slurm/train.sbatch with stand-ins for srun and scontrol; returns its exit code and scontrol's calls."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    calls = tmp_path / "scontrol.calls"
    (bin_dir / "srun").write_text(f"#!/bin/bash\n{srun_body}\n")
    (bin_dir / "scontrol").write_text(f'#!/bin/bash\necho "$@" >> {calls}\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_ID": "4242",
           "SLURM_SUBMIT_DIR": str(ROOT)}
    proc = subprocess.run(["bash", str(ROOT / "slurm" / "train.sbatch"), "model=toy"], env=env,
                          capture_output=True, text=True, timeout=timeout_s(60))
    return proc.returncode, calls.read_text() if calls.is_file() else ""


def test_sbatch_requeues_on_75_and_on_a_task_killed_by_a_preemption_signal(tmp_path: Path) -> None:
    assert _sbatch(tmp_path / "a", f"exit {REQUEUE_EXIT_CODE}") == (REQUEUE_EXIT_CODE, "requeue 4242\n")
    assert _sbatch(tmp_path / "b", "kill -TERM $$") == (143, "requeue 4242\n")  # died before its handlers
    assert _sbatch(tmp_path / "c", "kill -USR1 $$") == (138, "requeue 4242\n")
    assert _sbatch(tmp_path / "d", "exit 0") == (0, "")
    assert _sbatch(tmp_path / "e", "exit 1") == (1, "")  # a failure is not requeued


_INTERCEPTING_IMPORT = """
import os, signal, sys
from trainer.preemption import exit_on_signals
exit_on_signals()
try:  # a third-party import that turns whatever it meets into its own error, as numpy's does when half-built
    os.kill(os.getpid(), signal.{sig})
    for _ in range(10_000_000):
        pass
except BaseException as err:
    raise AttributeError("partially initialised module") from err
sys.exit(3)
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGUSR1", "SIGUSR2"])
def test_a_start_up_signal_exits_75_even_inside_code_that_intercepts_exceptions(sig: str) -> None:
    proc = subprocess.run([sys.executable, "-c", _INTERCEPTING_IMPORT.format(sig=sig)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=timeout_s(30))
    assert proc.returncode == REQUEUE_EXIT_CODE, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"{sig} during start-up: exiting 75 for a requeue"]
