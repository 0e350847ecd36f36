"""The Triton kernels (fused gains forward and backward, fused recurrent decoding) on the CPU, through Triton's
interpreter.

``TRITON_INTERPRET=1`` must be set before ``kdn.triton_ops`` is imported, so the checks run in a fresh
interpreter. Gains are compared in FP32 with the float64 PyTorch reference (``kdn.gain``): value, final
uncertainty and the gradient of every input (``mu`` and the initial uncertainty included). Sizes cross the
kernels' chunk boundaries (32 tokens for ``K <= 64``, 16 above), ``K`` is not a power of two, some tokens
forget strongly (``g`` down to -12).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from kdn import gain as ref, naive, triton_ops
from kdn_inputs import make_inputs, make_state, rel_err


def gain_case(iso, B, T, H, K, dtype, dplr=False):
    # float64 reference on the same (dtype-rounded) key; every input a leaf
    x = make_inputs(B, T, H, K, K, isotropic=iso, seed=T + K, g_min=-3.0)
    x["g"][:, T // 2:T // 2 + 4] *= 4.0  # strong forgetting: g down to -12
    x["k"] = x["k"].to(dtype).double()
    u0 = make_state(B, H, K, K, isotropic=iso)[1]
    mu = torch.linspace(1.0, float(K), H, dtype=torch.float64)
    l64 = {n: x[n].clone().requires_grad_() for n in ("k", "g", "omega", "r")}
    l64 |= {"mu": mu.requires_grad_(), "u0": u0.requires_grad_()}
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    l32["k"] = l64["k"].detach().to(dtype).requires_grad_()
    args64 = [l64[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    args32 = [l32[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    if iso:
        outs64 = ref.isotropic_gain(*args64)
        outs32 = triton_ops.isotropic_gain(*args32, out_dtype=dtype)
    elif dplr:
        kappa, pT = ref.diagonal_gain(*args64)
        outs64 = (kappa, l64["g"].exp() * l64["k"], -kappa, pT)
        outs32 = triton_ops.diagonal_gain_dplr(*args32, out_dtype=dtype)
    else:
        outs64 = ref.diagonal_gain(*args64)
        outs32 = triton_ops.diagonal_gain(*args32, out_dtype=dtype)
    assert outs32[0].dtype == dtype and outs32[-1].dtype == torch.float32
    gen = torch.Generator().manual_seed(0)
    ups = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs64]
    sum((o * u).sum() for o, u in zip(outs64, ups)).backward()
    sum((o.double() * u).sum() for o, u in zip(outs32, ups)).backward()
    names = ("gain", "a", "b", "final") if len(outs64) == 4 else ("gain", "final")
    errs = {n: rel_err(o32, o64) for n, o32, o64 in zip(names, outs32, outs64)}
    assert l32["k"].grad.dtype == dtype
    return errs | {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}


out = {}
for iso in (False, True):
    tag = "iso" if iso else "diag"
    out[tag] = (1e-5, gain_case(iso, 2, 77, 3, 12, torch.float32))
    out[tag + "_bf16"] = (1e-2, gain_case(iso, 1, 64, 2, 12, torch.bfloat16))
out["diag_dplr_K72"] = (1e-5, gain_case(False, 1, 37, 2, 72, torch.float32, dplr=True))

# the fused recurrent (decoding) kernel: several tokens, K not a power of two, two value blocks
for iso in (False, True):
    B, T, H, K, V = 2, 5, 3, 12, 40
    x = make_inputs(B, T, H, K, V, isotropic=iso, seed=8)
    S0, u0 = make_state(B, H, K, V, isotropic=iso)
    mu = torch.tensor([0.5, 3.0, 12.0], dtype=torch.float64)
    rec = naive.isotropic_kdn_recurrent if iso else naive.diagonal_kdn_recurrent
    o64, (S64, e64) = rec(x["q"], x["k"], x["v"], x["g"], x["omega"], x["r"], mu, (S0, u0))
    x32 = [x[n].float() for n in ("q", "k", "v", "g", "omega", "r")]
    o32, (S32, e32) = triton_ops.fused_recurrent(*x32, mu.float(), (S0.float(), u0.float()), iso)
    out[("iso" if iso else "diag") + "_recurrent"] = (1e-5, {"o": rel_err(o32, o64), "S": rel_err(S32, S64),
                                                             "final": rel_err(e32, e64)})
print(json.dumps(out))
"""


def test_triton_kernels_in_interpreter_match_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(results) == 7
    for variant, (tol, errs) in results.items():
        assert max(errs.values()) < tol, (variant, errs)
