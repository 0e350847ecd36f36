"""The Triton kernels (gain scans forward and backward, fused recurrent decoding) on the CPU, through
Triton's interpreter.

``TRITON_INTERPRET=1`` must be set before ``kdn.triton_ops`` is imported, so the check runs in a fresh
interpreter. Sizes cross the kernel's chunk (32 tokens) and channel-block (32) boundaries.
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
out = {}
for iso in (False, True):
    B, T, H, K = 2, 77, 3, 12
    x = make_inputs(B, T, H, K, K, isotropic=iso, seed=3, g_min=-3.0)
    u0 = make_state(B, H, K, K, isotropic=iso)[1]
    l64 = {n: x[n].clone().requires_grad_() for n in ("k", "g", "omega", "r")} | {"u0": u0.requires_grad_()}
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    mu = torch.tensor([1.0, 3.0, 12.0])
    fr, ft = (ref.isotropic_gain, triton_ops.isotropic_gain) if iso else (ref.diagonal_gain, triton_ops.diagonal_gain)
    g64, e64 = fr(l64["k"], l64["g"], l64["omega"], l64["r"], mu.double(), l64["u0"])
    g32, e32 = ft(l32["k"], l32["g"], l32["omega"], l32["r"], mu, l32["u0"])
    up, upT = torch.randn_like(g64), torch.randn_like(e64)
    ((g64 * up).sum() + (e64 * upT).sum()).backward()
    ((g32.double() * up).sum() + (e32.double() * upT).sum()).backward()
    errs = {"gain": rel_err(g32, g64), "final": rel_err(e32, e64)}
    errs |= {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}
    out["iso" if iso else "diag"] = errs
    # the fused recurrent (decoding) kernel: several tokens, K not a power of two, two value blocks
    B, T, H, K, V = 2, 5, 3, 12, 40
    x = make_inputs(B, T, H, K, V, isotropic=iso, seed=8)
    S0, u0 = make_state(B, H, K, V, isotropic=iso)
    mu = torch.tensor([0.5, 3.0, 12.0], dtype=torch.float64)
    rec = naive.isotropic_kdn_recurrent if iso else naive.diagonal_kdn_recurrent
    o64, (S64, e64) = rec(x["q"], x["k"], x["v"], x["g"], x["omega"], x["r"], mu, (S0, u0))
    x32 = [x[n].float() for n in ("q", "k", "v", "g", "omega", "r")]
    o32, (S32, e32) = triton_ops.fused_recurrent(*x32, mu.float(), (S0.float(), u0.float()), iso)
    out[("iso" if iso else "diag") + "_recurrent"] = {"o": rel_err(o32, o64), "S": rel_err(S32, S64),
                                                       "final": rel_err(e32, e64)}
print(json.dumps(out))
"""


def test_triton_gain_scan_in_interpreter_matches_reference() -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    errs = json.loads(proc.stdout.strip().splitlines()[-1])
    for variant, e in errs.items():
        assert max(e.values()) < 1e-5, (variant, e)
