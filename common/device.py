"""The device a tool runs on, and the name its results record for it.

``resolve_device("auto")`` is CUDA when a CUDA device is visible, else the CPU; any other name is taken as
``torch.device`` spells it (``cpu``, ``cuda``, ``cuda:1``). ``device_name`` is what results files and timing tables
key on: the GPU's marketing name (``"NVIDIA H200"``), and ``"cpu"`` for the CPU, so that results written on
different CPU machines compare as one device class rather than by processor string.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from common.options import OptionError

if TYPE_CHECKING:  # imported by the functions: the launchers and sweeps import common and never touch a tensor
    import torch


def resolve_device(name: str, key: str = "device") -> torch.device:
    """The ``torch.device`` for ``name`` (``auto``, ``cpu``, ``cuda`` or ``cuda:N``); ``key`` names the option in the
    one-line :class:`OptionError` raised for a name that is no device or a CUDA device this machine lacks."""
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError):
        raise OptionError(f"{key}={name!r} is not a device: use auto, cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise OptionError(f"{key}={name!r} but no CUDA device is visible: use {key}=auto or {key}=cpu")
    return device


def device_name(device: torch.device | str) -> str:
    """``"NVIDIA H200"``-style name of a CUDA device, else the device's type (``"cpu"``)."""
    import torch

    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
