"""The fused short convolutions of the front end (``kdn.modules.conv.front_conv``) against float64: the CPU through
Triton's interpreter, and CUDA. Outputs (``q, k`` normalised per head, ``v``, the passed-through columns) and the
gradients of the joint projection and of the taps; batch rows and packed sequences (some shorter than the taps),
``V != K``, FP32 and bf16. The one-token step (``front_conv_step``): its outputs and the conv windows it updates in
place, against the PyTorch path's cached step in float64."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

CHECK = r"""
import torch
import torch.nn.functional as F
from kdn.modules import ShortConv
from kdn.modules.conv import front_conv, front_conv_step
from kdn_inputs import rel_err


def reference(y, w, H, K, V, cu):
    # float64 through the PyTorch path of the front end: ShortConv per stream, then F.normalize
    B, T, _ = y.shape
    outs, at = [], 0
    for width, norm, d in ((H * K, True, K), (H * K, True, K), (H * V, False, V)):
        conv = ShortConv(width, w.shape[1])
        s, _ = torch.func.functional_call(conv, {"weight": w[at:at + width, None, :]}, (y[..., at:at + width],),
                                          {"cu_seqlens": cu})
        s = s.view(B, T, H, d)
        outs.append(F.normalize(s, dim=-1) if norm else s)
        at += width
    return (*outs, y[..., at:])


def check(device, dtype, B, T, H, K, V, extra, lens, seed, **tiles):
    gen = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    y = (torch.randn(B, T, C + extra, generator=gen) * 2).to(device, dtype)
    w = (torch.randn(C, 4, generator=gen) / 2).to(device)
    cu = None
    if lens is not None:
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=device)
    grads = [torch.randn(B, T, H, K, generator=gen), torch.randn(B, T, H, K, generator=gen),
             torch.randn(B, T, H, V, generator=gen), torch.randn(B, T, extra, generator=gen)]
    grads = [g.to(device) for g in grads]
    ys, ws = y.clone().requires_grad_(), w.clone().requires_grad_()
    outs = front_conv(ys, ws, H, K, V, 1e-12, cu, **tiles)
    assert [o.dtype for o in outs] == [dtype] * 4
    torch.autograd.backward(outs, [g.to(dtype) for g in grads])
    y64, w64 = y.double().requires_grad_(), w.double().requires_grad_()
    refs = reference(y64, w64, H, K, V, cu)
    torch.autograd.backward(refs, [g.double() for g in grads])
    errs = {n: rel_err(o, r) for n, o, r in zip(("q", "k", "v", "rest"), outs, refs)}
    errs["dy"] = rel_err(ys.grad, y64.grad)
    errs["dw"] = rel_err(ws.grad, w64.grad)
    return errs


def check_step(device, dtype, B, H, K, V, extra, seed):
    # one token over random conv windows: outputs and the windows after the step, against ShortConv's cached step
    gen = torch.Generator().manual_seed(seed)
    C = H * (2 * K + V)
    y = (torch.randn(B, 1, C + extra, generator=gen) * 2).to(device, dtype)
    w = (torch.randn(C, 4, generator=gen) / 2).to(device)
    widths = (H * K, H * K, H * V)
    state = tuple((torch.randn(B, d, 3, generator=gen) * 2).to(device, dtype) for d in widths)
    ptrs = [s.data_ptr() for s in state]
    ref_in = [s.double() for s in state]
    outs = front_conv_step(y, w, state, H, K, V, 1e-12)
    assert [o.dtype for o in outs] == [dtype] * 3 and [s.data_ptr() for s in state] == ptrs
    errs, at = {}, 0
    for name, o, s, s0, d, norm in zip("qkv", outs, state, ref_in, (K, K, V), (True, True, False)):
        width = s.shape[1]
        conv = ShortConv(width, 4)
        r, new = torch.func.functional_call(conv, {"weight": w.double()[at:at + width, None, :]},
                                            (y.double()[..., at:at + width], s0), {"output_final_state": True})
        r = r.view(B, 1, H, d)
        errs[name] = rel_err(o, F.normalize(r, dim=-1) if norm else r)
        errs["window_" + name] = rel_err(s, new)
        at += width
    return errs
"""

STEP_CASES = {  # dtype, B, H, K, V, passed-through columns
    "fp32": ("float32", 3, 2, 16, 16, 5),
    "fp32_wide_v": ("float32", 1, 3, 8, 16, 0),
    "bf16": ("bfloat16", 2, 2, 16, 16, 7),
}

CASES = {  # dtype, B, T, H, K, V, passed-through columns, packed lengths
    "fp32": ("float32", 2, 37, 2, 16, 16, 5, None),
    "fp32_aligned": ("float32", 3, 32, 2, 16, 16, 4, None),  # T a multiple of the tokens per program: no masks
    "fp32_wide_v": ("float32", 1, 45, 3, 8, 16, 0, None),
    "fp32_packed": ("float32", 1, 40, 2, 16, 16, 3, (5, 1, 0, 20, 11, 3)),
    "bf16": ("bfloat16", 2, 33, 2, 16, 16, 7, None),
}

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.lean_device_calls()
""" + CHECK + r"""
cases, step_cases = json.loads(sys.argv[1]), json.loads(sys.argv[2])
tiles = {"tokens_fwd": 16, "tokens_bwd": 8}  # several programs along the tokens, some token blocks ending mid-sequence
errs = {n: check("cpu", getattr(torch, c[0]), *c[1:7], c[7], i, **tiles) for i, (n, c) in enumerate(cases.items())}
errs |= {"step_" + n: check_step("cpu", getattr(torch, c[0]), *c[1:], i) for i, (n, c) in enumerate(step_cases.items())}
print(json.dumps(errs))
"""


def _assert_close(errs: dict, dtype: str) -> None:
    for case, e in errs.items():
        tol = 1e-6 if dtype == "float32" else 1e-2
        assert max(e.values()) < tol, (case, e)


def test_front_conv_in_interpreter_matches_float64() -> None:
    import json

    errs = triton_interpret.run_interpreted(SCRIPT, json.dumps(CASES), json.dumps(STEP_CASES))
    assert set(errs) == set(CASES) | {"step_" + n for n in STEP_CASES}
    for case, e in errs.items():
        dtype = STEP_CASES[case[5:]][0] if case.startswith("step_") else CASES[case][0]
        _assert_close({case: e}, dtype)


COMPILE = r"""
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kdn.modules import conv as tc

n = 0
for kernel in (tc._front_conv1d_fwd_kernel, tc._front_conv1d_bwd_kernel):
    for varlen, G, masked in ((True, 4, True), (False, 1, False), (False, 2, True)):
        consts = {"W": 4, "G": G, "BD": 128, "IS_VARLEN": varlen, "MASKED": masked}
        sig, cst = {}, {}
        for i, name in enumerate(kernel.arg_names):
            if name in consts or (name == "pos_ptr" and not varlen):
                sig[name], cst[(i,)] = "constexpr", consts.get(name)
            elif name.endswith("_ptr"):
                sig[name] = {"pos_ptr": "*i32", "w_ptr": "*fp32", "dw_ptr": "*fp32"}.get(name, "*bf16")
            else:
                sig[name] = "fp32" if name == "eps" else "i32"
        triton.compile(ASTSource(kernel, sig, cst), target=GPUTarget("cuda", 90, 32), options={"num_warps": G})
        n += 1
kernel = tc._front_conv1d_step_kernel
sig, cst = {}, {}
for i, name in enumerate(kernel.arg_names):
    if name in ("W", "G", "BD"):
        sig[name], cst[(i,)] = "constexpr", {"W": 4, "G": 1, "BD": 128}[name]
    else:
        sig[name] = "*fp32" if name == "w_ptr" else "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" \
            else "i32"
triton.compile(ASTSource(kernel, sig, cst), target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
print(n + 1)
"""


def test_front_conv_kernels_compile_for_hopper(tmp_path: Path) -> None:
    """The compiled path types values strictly (the interpreter does not): both kernels compile to sm_90 cubins on
    the CPU (Triton's bundled ptxas), packed (int32 positions, 4 heads a program) and batched (1 and 2 heads, the
    taps masked by position and not), and so does the one-token step."""
    assert triton_interpret.compile_for_hopper(COMPILE, tmp_path).split()[-1] == "7"


def test_front_conv_rejects_bad_shapes() -> None:
    from kdn.modules.conv import front_conv

    with pytest.raises(ValueError, match="weight"):
        front_conv(torch.randn(1, 4, 40), torch.randn(40, 4), 2, 8, 8)  # C = 48 > 40 columns
    with pytest.raises(ValueError, match="B = 1"):
        front_conv(torch.randn(2, 4, 48), torch.randn(48, 4), 2, 8, 8, cu_seqlens=torch.tensor([0, 4]))
    from kdn.modules.conv import front_conv_step

    windows = (torch.randn(2, 16, 3), torch.randn(2, 16, 3), torch.randn(2, 16, 3))
    with pytest.raises(ValueError, match=r"y \[B, 1"):
        front_conv_step(torch.randn(2, 2, 48), torch.randn(48, 4), windows, 2, 8, 8)
    with pytest.raises(ValueError, match="contiguous conv windows"):
        front_conv_step(torch.randn(2, 1, 48), torch.randn(48, 4), (windows[0], windows[1], windows[2][:, :8]),
                        2, 8, 8)


def _cuda_checks() -> dict:
    """``CHECK``'s functions, run in this process on CUDA (the test is skipped without it)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    sys.path.insert(0, "tests")
    scope: dict = {}
    exec(CHECK, scope)
    return scope


@pytest.mark.gpu
@pytest.mark.parametrize("case", [
    ("float32", 2, 300, 4, 64, 64, 9, None),
    ("bfloat16", 2, 1000, 16, 128, 128, 400, None),
    ("bfloat16", 2, 1024, 16, 128, 128, 400, None),  # T a multiple of the tokens per program: no masks
    ("bfloat16", 1, 900, 4, 128, 256, 16, (300, 2, 0, 450, 148)),
])
def test_front_conv_on_cuda_matches_float64(case: tuple) -> None:
    check = _cuda_checks()["check"]
    _assert_close({"cuda": check("cuda", getattr(torch, case[0]), *case[1:7], case[7], 0)}, case[0])


@pytest.mark.gpu
@pytest.mark.parametrize("case", [("float32", 3, 4, 64, 64, 9), ("bfloat16", 64, 16, 128, 128, 400),
                                  ("bfloat16", 1, 4, 128, 256, 16)])
def test_front_conv_step_on_cuda_matches_float64(case: tuple) -> None:
    check_step = _cuda_checks()["check_step"]
    _assert_close({"cuda": check_step("cuda", getattr(torch, case[0]), *case[1:], 0)}, case[0])
