"""Optional Mamba-3 CUDA kernels from ``mamba-ssm`` (Triton SISO, TileLang MIMO).

``mamba_ssm/__init__.py`` imports the compiled ``selective_scan_cuda`` extension, which a build with
``MAMBA_SKIP_CUDA_BUILD=TRUE`` does not contain, although the Mamba-3 kernels are pure Python
(Triton / TileLang). When the package's ``__init__`` fails, the package is registered as a bare
namespace (its ``__init__`` skipped) so that the Mamba-3 modules import on their own.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
import types
from collections.abc import Callable

UNAVAILABLE: dict[str, str] = {}
"""Why a kernel could not be loaded, by kernel name (filled by :func:`mamba3_kernels`)."""


def _import_package_without_init() -> bool:
    spec = importlib.util.find_spec("mamba_ssm")
    if spec is None or spec.submodule_search_locations is None:
        return False
    if "mamba_ssm" in sys.modules:
        return True
    try:
        importlib.import_module("mamba_ssm")
    except ImportError:
        package = types.ModuleType("mamba_ssm")
        package.__path__ = list(spec.submodule_search_locations)
        package.__spec__ = spec
        sys.modules["mamba_ssm"] = package
    return True


def _load(module: str, name: str) -> Callable | None:
    try:
        return getattr(importlib.import_module(module), name)
    except Exception as error:  # missing triton / tilelang, or an incompatible version: fall back to PyTorch
        UNAVAILABLE[name] = f"{type(error).__name__}: {error}"
        return None


@functools.cache
def mamba3_kernels() -> tuple[Callable | None, Callable | None]:
    """``(mamba3_siso_combined, mamba3_mimo)``; each ``None`` when it cannot be imported."""
    if not _import_package_without_init():
        return None, None
    siso = _load("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined")
    mimo = _load("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba3_mimo")
    return siso, mimo
