"""FP32-accurate variants of the memory's Triton kernels, for ``precision="fp32"`` (docs/kernels.md, "Precision").

Triton 3.6 resolves a ``tl.dot`` without ``input_precision`` at trace time from ``triton.knobs.language.fp32_default``
(env ``TRITON_F32_DEFAULT``), else ``"tf32"``: FP32 operands then round to TF32's 10-bit mantissa. The compile
option ``default_dot_input_precision`` is part of the kernel cache key but does not reach ``tl.dot``; the knob reaches
it but is not part of the in-process cache key. So an FP32-accurate kernel here is a copy of the kernel object
(:func:`precise_kernel`) with caches of its own, whose launches pass the option (a key of their own, in memory and on
disk) and trace with the knob set to ``"tf32x3"`` for the launch alone (restored on exit, exceptions included). Dots
that name their precision keep it (fla's ``tf32x3`` triangular solve, its ``bf16x3`` safe-gate blocks). The kernels
of the default precision are the originals, untouched: bf16 and FP32 variants coexist, each compiled and autotuned
once. :func:`precise_launcher` gives a host function (fla's launchers, ours) whose kernels resolve to such copies,
without editing the function's module. Under Triton's interpreter, whose dots are exact FP32, the kernels are
returned as they are.
"""
from __future__ import annotations

import copy
import inspect
import types
from collections.abc import Callable
from typing import Any

import torch
import triton
from triton.runtime.autotuner import Autotuner, Heuristics
from triton.runtime.jit import JITFunction

DOT_PRECISION = "tf32x3"


class _PreciseJIT(JITFunction):
    """A ``JITFunction`` whose unspecified ``tl.dot`` precision is :data:`DOT_PRECISION`, with a source key of its own:
    the autotuner's disk cache keys its results by it, so the copy's tuned configurations are stored apart from the
    original's."""

    @property
    def cache_key(self) -> str:
        return f"{super().cache_key}-{DOT_PRECISION}"

    def run(self, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        kwargs["default_dot_input_precision"] = DOT_PRECISION  # the cache key: apart from the default kernels'
        with triton.knobs.language.scope():  # what tl.dot reads while tracing; the scope restores it and its env
            triton.knobs.language.fp32_default = DOT_PRECISION
            return super().run(*args, grid=grid, warmup=warmup, **kwargs)


_KERNELS: dict[int, Any] = {}
_LAUNCHERS: dict[Callable, Callable] = {}


def _is_kernel(obj: object) -> bool:
    return isinstance(obj, (JITFunction, Autotuner, Heuristics))


def precise_kernel(kernel: Any) -> Any:
    """The FP32-accurate copy of ``kernel`` (a ``@triton.jit`` function, possibly under ``@triton.heuristics`` and
    ``@triton.autotune``: each wrapper is copied around the copied kernel, the autotuner as Triton's own, with an
    empty cache, so that it times the copy, and its results kept in Triton's disk cache under the copy's key); made
    once per kernel. Under the interpreter, ``kernel`` itself."""
    if triton.knobs.runtime.interpret:
        return kernel
    key = id(kernel)
    if key not in _KERNELS:
        if isinstance(kernel, JITFunction):
            new = _PreciseJIT(kernel.fn, version=kernel.version, do_not_specialize=kernel.do_not_specialize,
                              do_not_specialize_on_alignment=kernel.do_not_specialize_on_alignment,
                              debug=kernel.debug, noinline=kernel.noinline, repr=kernel._repr,
                              launch_metadata=kernel.launch_metadata)
        elif isinstance(kernel, (Autotuner, Heuristics)):
            new = copy.copy(kernel)
            new.fn = precise_kernel(kernel.fn)
            if isinstance(kernel, Autotuner):  # the copy tunes itself (configs chosen for the default kernel can
                # overflow shared memory with TF32x3's split operands) once per machine: its timings go to Triton's
                # disk cache under the copy's own key, and so into the autotune tarballs of bench/gpu.sh
                new.cache, new.cache_results = {}, True
                if type(kernel) is not Autotuner:  # fla's autotuner first reads configs stored for that kernel
                    new.__class__ = Autotuner
        else:
            raise TypeError(f"precise_kernel takes a Triton kernel, got {type(kernel).__name__}")
        _KERNELS[key] = (kernel, new)  # the original too: its id stays its own while the entry lives
    return _KERNELS[key][1]


def precise_launcher(fn: Callable) -> Callable:
    """``fn`` (a Python function that launches Triton kernels by their global names) as a function of the same code
    whose globals name the :func:`precise_kernel` copies of those kernels; made once per function. A decorated
    ``fn`` (fla's backend dispatch) is unwrapped first: the copy is the Triton implementation itself, kept out of
    ``torch.compile`` graphs as fla keeps its launchers."""
    if fn not in _LAUNCHERS:
        inner = inspect.unwrap(fn)
        scope = dict(inner.__globals__)
        for name in inner.__code__.co_names:
            if _is_kernel(scope.get(name)):
                scope[name] = precise_kernel(scope[name])
        new = types.FunctionType(inner.__code__, scope, inner.__name__, inner.__defaults__, inner.__closure__)
        new.__kwdefaults__ = inner.__kwdefaults__
        _LAUNCHERS[fn] = torch.compiler.disable(new)
    return _LAUNCHERS[fn]


def maybe_precise(fn: Callable, precise: bool) -> Callable:
    """``fn`` (a kernel or a launcher), or its FP32-accurate copy when ``precise`` (:func:`precise_launcher` for a
    Python function, :func:`precise_kernel` for a kernel)."""
    if not precise:
        return fn
    return precise_launcher(fn) if isinstance(fn, types.FunctionType) else precise_kernel(fn)
