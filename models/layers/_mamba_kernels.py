"""Optional Mamba-3 CUDA kernels from ``mamba-ssm`` (Triton SISO, TileLang MIMO).

``mamba_ssm/__init__.py`` imports the compiled ``selective_scan_cuda`` extension, which a build with
``MAMBA_SKIP_CUDA_BUILD=TRUE`` does not contain, although the Mamba-3 kernels are pure Python
(Triton / TileLang). When the package's ``__init__`` fails, the package is registered as a bare
namespace (its ``__init__`` skipped) so that the Mamba-3 modules import on their own.

mamba-ssm's MIMO wrappers ask TileLang for their kernel on every call with new ``T.dynamic("B")`` (and ``S``,
``H``, ``G``) variables. TileLang keys its compiled kernels on those variables, which compare by identity, so
every call misses that cache, rebuilds the kernel's program and finds it again in a second cache keyed on the
program's text: host time on each of a training step's six kernel calls, and a cache that grows with every call.
:class:`ShapeStableJit` keys the kernels on the variables' names instead; a kernel compiled for symbolic
dimensions takes any size of them, so one serves every call of its arguments.
"""
from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)
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


MIMO_KERNEL_MODULES = tuple(f"mamba_ssm.ops.tilelang.mamba3.mamba3_mimo_{part}" for part in
                            ("fwd", "bwd", "fwd_varlen", "bwd_varlen"))
"""The modules whose TileLang kernel factories :func:`stabilise_tilelang_kernels` wraps."""


SYMBOLIC = "symbolic"
"""The tag of a symbolic dimension in :class:`ShapeStableJit`'s keys."""


class ShapeStableJit:
    """A TileLang ``@tilelang.jit`` kernel factory whose kernels are kept by argument, a symbolic dimension
    (an instance of ``var_type``) counting by its ``name`` and ``dtype`` rather than by identity.

    Args:
        factory: the ``tilelang.jit`` object, called as ``factory(*args, **kwargs) -> kernel``.
        var_type: TileLang's symbolic-dimension class (``tvm.tir.Var``).
    """

    def __init__(self, factory: Callable[..., Any], var_type: type) -> None:
        self.factory, self.var_type = factory, var_type
        self.kernels: dict[tuple, Any] = {}

    def _key(self, value: object) -> object:
        if isinstance(value, self.var_type):
            return (SYMBOLIC, value.name, str(value.dtype))
        return value

    @staticmethod
    def arguments(key: tuple, new_var: Callable[[str, str], object]) -> tuple[tuple, dict[str, object]]:
        """The ``(args, kwargs)`` of a kept kernel's ``key`` as mamba-ssm passes them: a new symbolic dimension,
        ``new_var(name, dtype)``, for each one."""
        def value(v: object) -> object:
            return new_var(v[1], v[2]) if isinstance(v, tuple) and len(v) == 3 and v[0] == SYMBOLIC else v

        args, kwargs = key
        return tuple(map(value, args)), {k: value(v) for k, v in kwargs}

    def __call__(self, *args: object, **kwargs: object) -> Any:
        key = (tuple(self._key(a) for a in args), tuple(sorted((k, self._key(v)) for k, v in kwargs.items())))
        kernel = self.kernels.get(key)
        if kernel is None:
            kernel = self.kernels[key] = self.factory(*args, **kwargs)
        return kernel

    def __getattr__(self, name: str) -> Any:  # the factory's other methods (get_tir, compile, ...)
        return getattr(self.factory, name)


def stabilise_tilelang_kernels(modules: tuple[str, ...], jit_type: type, var_type: type) -> int:
    """Wrap every ``jit_type`` object at the top level of ``modules`` (imported ones) in :class:`ShapeStableJit`,
    where the wrappers look it up when they run; a module already wrapped is left as it is.

    Returns:
        How many factories were wrapped.
    """
    wrapped = 0
    for name in modules:
        module = sys.modules.get(name)
        if module is None:
            continue
        for attr, value in list(vars(module).items()):
            if isinstance(value, jit_type):
                setattr(module, attr, ShapeStableJit(value, var_type))
                wrapped += 1
    return wrapped


def _stabilise_mimo() -> None:
    try:
        import tilelang.language as T
        from tilelang.jit import JITImpl
    except Exception as error:  # a TileLang without these names: its own dispatch still computes the same kernels
        logger.warning("TileLang's kernel factories not wrapped (%s: %s): every MIMO kernel call rebuilds its "
                       "program", type(error).__name__, error)
        return
    stabilise_tilelang_kernels(MIMO_KERNEL_MODULES, JITImpl, type(T.dynamic("B")))


@functools.cache
def mamba3_kernels() -> tuple[Callable | None, Callable | None]:
    """``(mamba3_siso_combined, mamba3_mimo)``; each ``None`` when it cannot be imported."""
    if not _import_package_without_init():
        return None, None
    siso = _load("mamba_ssm.ops.triton.mamba3.mamba3_siso_combined", "mamba3_siso_combined")
    mimo = _load("mamba_ssm.ops.tilelang.mamba3.mamba3_mimo", "mamba3_mimo")
    if mimo is not None:
        _stabilise_mimo()
    return siso, mimo
