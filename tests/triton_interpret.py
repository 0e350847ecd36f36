"""Run fla's Triton kernels on the CPU through Triton's interpreter: a test harness for the CUDA backend.

Import it in a process started with ``TRITON_INTERPRET=1`` and call :func:`enable` before running kernels;
:func:`run_interpreted` starts such a process from a test.
Four gaps of the interpreter are bridged: autotuners cannot benchmark (the first config is taken); loop
indices of ``range`` are plain ints inside interpreted kernels while fla calls ``.to()`` on them (fla's
modules get a ``range`` that yields int32 scalars while a kernel runs); fla's alias of ``tl.gather`` is not
patched by the interpreter (fla's modules see ``IS_GATHER_SUPPORTED = False``, so its kernels load the row
instead of gathering it); and the interpreter's dot has no ``bf16x3`` precision (fla's safe-gate diagonal
blocks run at ``ieee`` here). :func:`lean_device_calls` (part of :func:`enable`, or alone for kernels that need
none of the bridges) removes a cost, not a gap: the interpreter's repeated patching of the language on every device
function call.
"""
from __future__ import annotations

import builtins
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
import triton.language as tl
import triton.runtime.autotuner as autotuner
import triton.runtime.interpreter as interpreter
from conftest import timeout_s
from forkserver import ROOT, command_env, shared

# what every interpreted script imports, before any of this repository's code
PRELOADED = ("numpy", "torch", "torch.nn.attention.flex_attention", "transformers", "triton", "triton.language", "fla")
_in_kernel = [0]
_patched: set[int] = set()  # the language modules patched in the running launch (ids)


def run_interpreted(script: str, *args: str, timeout: float = 600) -> dict:
    """Run ``script`` (``python -c``, with ``args``) in a process of its own with ``TRITON_INTERPRET=1`` at the
    repository root (a fork of the fork server that imported :data:`PRELOADED` under ``TRITON_INTERPRET=1``); it must
    print a JSON object as its last line, which is returned. ``timeout``: seconds on an idle machine, scaled by the
    suite's factor (``conftest.timeout_s``)."""
    proc = shared(PRELOADED, TRITON_INTERPRET="1").run(["-c", script, *args], command_env(TRITON_INTERPRET="1"),
                                                       ROOT, timeout_s(timeout))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_MANY = r"""
import contextlib, io, json, sys, traceback
out = {}
for name, (script, *args) in json.loads(sys.argv[1]).items():
    sys.argv, buf = ["-c", *args], io.StringIO()
    try:
        with contextlib.redirect_stdout(buf):
            exec(compile(script, f"<{name}>", "exec"), {"__name__": "__main__"})
        out[name] = json.loads(buf.getvalue().strip().splitlines()[-1])
    except Exception:
        out[name] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(out))
"""


def run_interpreted_many(scripts: dict[str, tuple[str, ...]], timeout: float = 600) -> dict[str, dict]:
    """Run several scripts of :func:`run_interpreted`, each ``(script, *args)`` by name, one after another in one
    process: the kernels a module's cases share are interpreted in one process, not once a test. Returns each one's
    JSON object by name; one that raised gives ``{"error": its traceback}`` (:func:`result` raises it)."""
    return run_interpreted(_MANY, json.dumps(scripts), timeout=timeout)


def result(results: dict[str, dict], name: str) -> dict:
    """Script ``name``'s object in :func:`run_interpreted_many`'s ``results``; fails with its traceback if it raised."""
    out = results[name]
    assert set(out) != {"error"}, f"{name} raised:\n{out.get('error')}"
    return out


def compile_for_hopper(script: str, cache_dir: Path, timeout: float = 600) -> str:
    """Run ``script`` (``python -c``) with the compiler, not the interpreter, and a fresh ``TRITON_CACHE_DIR`` at the
    repository root, to compile kernels for sm_90 on the CPU with Triton's bundled ptxas (the test is skipped when
    there is none); it must succeed. Returns its stdout. ``timeout``: as in :func:`run_interpreted`."""
    import pytest
    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(90).path
    except (RuntimeError, FileNotFoundError):
        ptxas = None
    if not ptxas:
        pytest.skip("Triton's NVIDIA backend has no ptxas here")
    env = {n: v for n, v in os.environ.items() if n != "TRITON_INTERPRET"}
    env |= {"PYTHONPATH": str(ROOT), "TRITON_CACHE_DIR": str(cache_dir)}
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout_s(timeout))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _scalar(i: int) -> tl.core.tensor:
    return tl.core.tensor(interpreter.TensorHandle(np.array([i], dtype=np.int32), tl.int32), tl.int32)


def kernel_range(*args: int) -> Iterable:
    """``range``; inside an interpreted kernel its values are int32 scalars, as in compiled Triton."""
    if not _in_kernel[0]:
        return builtins.range(*args)
    return (_scalar(i) for i in builtins.range(*(int(a) for a in args)))


def lean_device_calls() -> None:
    """Count the running kernel launches (for :func:`kernel_range`) and skip the interpreter's repeated patching.

    Every call of a device function (fla's ``exp2``, its helpers) re-patches every builtin of ``triton.language``
    (``inspect.getmembers`` over each module): about a third of an interpreted kernel's time. Within a launch a
    repeat changes nothing (patched members are no longer builtins), so it is skipped for the modules the launch
    patched already. Installed once per process, however often it is called."""
    if getattr(interpreter.GridExecutor.__call__, "counts_launches", False):
        return
    call, patch_lang = interpreter.GridExecutor.__call__, interpreter._patch_lang

    def counted(self: interpreter.GridExecutor, *args: object, **kwargs: object) -> object:
        _in_kernel[0] += 1
        _patched.clear()
        try:
            return call(self, *args, **kwargs)
        finally:
            _in_kernel[0] -= 1

    def patch_once(fn: Callable) -> interpreter._LangPatchScope:
        langs = {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}
        if langs <= _patched:  # a device function's call (the launch's own patching cleared the set)
            return interpreter._LangPatchScope()
        _patched.update(langs)
        return patch_lang(fn)

    counted.counts_launches = True
    interpreter.GridExecutor.__call__ = counted
    interpreter._patch_lang = patch_once


def enable(*modules: str) -> None:
    """Patch the interpreter for fla (and :func:`lean_device_calls`); import ``modules`` (fla ops or layers) first so
    that they are patched."""
    run = autotuner.Autotuner.run

    def first_config(self: autotuner.Autotuner, *args: object, **kwargs: object) -> object:
        self.configs = self.configs[:1]
        return run(self, *args, **kwargs)

    autotuner.Autotuner.run = first_config
    lean_device_calls()
    for name in modules:
        importlib.import_module(name)
    for name, mod in list(sys.modules.items()):
        if name.startswith("fla.") and mod is not None:
            mod.range = kernel_range
            if hasattr(mod, "IS_GATHER_SUPPORTED"):
                mod.IS_GATHER_SUPPORTED = False
            if hasattr(mod, "SAFE_GATE_DOT_PRECISION"):
                mod.SAFE_GATE_DOT_PRECISION = tl.constexpr("ieee")
