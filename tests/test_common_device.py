"""One device resolution and one device name for every tool (``common.device``), and the CPU's name they record."""
from __future__ import annotations

import pytest
import torch
from conftest import timeout_s

from common import OptionError, device_name, resolve_device


def test_cpu_is_named_cpu_by_every_writer() -> None:
    """Results files, MQAR job files and their timing tables key on the device name: the CPU is ``"cpu"`` on every
    machine (not the processor string), and the writers share the one function."""
    import bench.eval_speed
    import eval.mqar.run
    import eval.suites

    assert device_name("cpu") == "cpu"
    assert device_name(torch.device("cpu")) == "cpu"
    for module in (eval.mqar.run, eval.suites, bench.eval_speed):
        assert module.device_name is device_name, module.__name__


def test_resolve_device_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto") == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    for name in ("cuda", "cuda:1"):
        with pytest.raises(OptionError, match=rf"^device='{name}' but no CUDA device is visible: use device=auto"):
            resolve_device(name)
    with pytest.raises(OptionError, match=r"^gpu_device='gpu' is not a device: use auto, cpu or cuda\[:N\]$"):
        resolve_device("gpu", "gpu_device")


def test_resolve_device_auto_takes_cuda_when_visible(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert resolve_device("auto") == torch.device("cuda")
    assert resolve_device("cuda:1") == torch.device("cuda", 1)


def test_trainer_and_mqar_resolve_through_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's device check is the shared one, raised as its one-line ``ConfigError`` on its key."""
    import eval.mqar.run
    from trainer.config import ConfigError, TrainerConfig
    from trainer.distributed import device_and_precision

    assert eval.mqar.run.resolve_device is resolve_device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert device_and_precision(TrainerConfig(device="auto")) == (True, "fp32")
    with pytest.raises(ConfigError, match=r"^trainer\.device='cuda' but no CUDA device is visible: use "
                                          r"trainer\.device=auto or trainer\.device=cpu$"):
        device_and_precision(TrainerConfig(device="cuda"))


def test_the_launchers_start_without_torch() -> None:
    """``slurm.launch`` (one per node of every job), ``slurm.sweep`` and ``slurm.status`` only start processes and read
    files: importing them (and ``common``) must not import torch, about 2 s of each start."""
    import subprocess
    import sys
    from pathlib import Path

    probe = "import sys, common, slurm.launch, slurm.sweep, slurm.status; print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", probe], cwd=Path(__file__).resolve().parents[1], capture_output=True,
                          text=True, timeout=timeout_s(120))
    assert proc.returncode == 0 and proc.stdout.strip() == "False", proc.stdout + proc.stderr
