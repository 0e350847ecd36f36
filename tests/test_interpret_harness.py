"""The interpreter harness itself (``tests/triton_interpret.py``): its lean device calls patch the language once
per launch, and the kernels still compute what they compute without it."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys
import torch, triton, triton.language as tl
import triton.runtime.interpreter as interpreter
sys.path.insert(0, "tests")
import triton_interpret

real, calls = interpreter._patch_lang, []


def counting(fn):
    calls.append(fn.__name__)
    return real(fn)


@triton.jit
def twice(x):
    return x * 2.0


@triton.jit
def kernel(x, y, N: tl.constexpr):
    o = tl.arange(0, N)
    acc = tl.load(x + o)
    for _ in range(4):
        acc = twice(acc)
    tl.store(y + o, acc)


def launch():
    x = torch.arange(8, dtype=torch.float32) + 1
    y = torch.empty_like(x)
    kernel[(1,)](x, y, N=8)
    return (y / x).tolist()


interpreter._patch_lang = counting
plain = launch()
plain_calls = len(calls)
calls.clear()
triton_interpret.lean_device_calls()
triton_interpret.lean_device_calls()  # a second call installs nothing more
lean = [launch(), launch()]
print(json.dumps({"plain": plain, "plain_calls": plain_calls, "lean": lean, "lean_calls": calls}))
"""


def test_lean_device_calls_patch_once_per_launch_and_compute_the_same() -> None:
    out = triton_interpret.run_interpreted(SCRIPT)
    assert out["plain"] == [16.0] * 8 and out["lean"] == [[16.0] * 8] * 2
    assert out["plain_calls"] == 5  # the launch, then each of the four device calls
    assert out["lean_calls"] == ["kernel", "kernel"], out["lean_calls"]
