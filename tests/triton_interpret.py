"""Run fla's Triton kernels on the CPU through Triton's interpreter: a test harness for the CUDA backend.

Import it in a process started with ``TRITON_INTERPRET=1`` and call :func:`enable` before running kernels.
Two gaps of the interpreter are bridged: autotuners cannot benchmark (the first config is taken), and loop
indices of ``range`` are plain ints inside interpreted kernels while fla calls ``.to()`` on them (fla's
modules get a ``range`` that yields int32 scalars while a kernel runs).
"""
from __future__ import annotations

import builtins
import importlib
import sys
from collections.abc import Iterable

import numpy as np
import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter

_in_kernel = [0]


def _scalar(i: int) -> tl.core.tensor:
    return tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def kernel_range(*args: int) -> Iterable:
    """``range``; inside an interpreted kernel its values are int32 scalars, as in compiled Triton."""
    if not _in_kernel[0]:
        return builtins.range(*args)
    return (_scalar(i) for i in builtins.range(*(int(a) for a in args)))


def enable(*modules: str) -> None:
    """Patch the interpreter for fla; import ``modules`` (fla ops or layers) first so that they are patched."""
    run, call = autotuner.Autotuner.run, interpreter.GridExecutor.__call__

    def first_config(self: autotuner.Autotuner, *args: object, **kwargs: object) -> object:
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    def counted(self: interpreter.GridExecutor, *args: object, **kwargs: object) -> object:
        _in_kernel[0] += 1
        try:
            return call(self, *args, **kwargs)
        finally:
            _in_kernel[0] -= 1

    autotuner.Autotuner.run = first_config
    interpreter.GridExecutor.__call__ = counted
    for name in modules:
        importlib.import_module(name)
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and mod is not None:
            mod.range = kernel_range
