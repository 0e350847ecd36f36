"""The Triton kernels (fused gains forward and backward, fused recurrent decoding) on the CPU, through Triton's
interpreter.

``TRITON_INTERPRET=1`` must be set before ``kdn.triton_ops`` is imported, so the checks run in a fresh
interpreter. Gains are compared in FP32 with the float64 PyTorch reference (``kdn.gain``): value, final
uncertainty and the gradient of every input (``mu`` and the initial uncertainty included). Sizes cross the
kernels' chunk boundaries (32 tokens for ``K <= 64``, 16 above), ``K`` is not a power of two, some tokens
forget strongly (``g`` down to -12). Small forced segments (``triton_ops._SEG_OVERRIDE``) run the sequence-
parallel path: 3 segments of one or two chunks with a partial last one; other cases have a single segment.
"""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
from kdn import gain as ref, naive, triton_ops
from kdn_inputs import make_inputs, make_state, rel_err


def gain_case(iso, B, T, H, K, dtype, dplr=False, seg=None):
    # float64 reference on the same (dtype-rounded) key; every input a leaf; seg: tokens per segment
    triton_ops._SEG_OVERRIDE = seg
    bt = triton_ops._ISO_BT if iso else triton_ops._diag_tiles(K)[1]
    ns = triton_ops._segments(B * H, T, bt)[1]
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
    triton_ops._SEG_OVERRIDE = None
    return ns, errs | {"d" + n: rel_err(l32[n].grad, l64[n].grad) for n in l64}


out, segments = {}, {}
cases = {  # name: (tolerance, iso, B, T, H, K, dtype, dplr, tokens per segment)
    "diag_seg32": (1e-5, False, 2, 77, 3, 12, torch.float32, False, 32),
    "diag_one_segment": (1e-5, False, 2, 77, 3, 12, torch.float32, False, None),
    "diag_dplr_K72_seg32": (1e-5, False, 1, 77, 2, 72, torch.float32, True, 32),
    "iso_seg32": (1e-5, True, 2, 77, 3, 12, torch.float32, False, 32),
    "iso_one_segment": (1e-5, True, 2, 77, 3, 12, torch.float32, False, None),
    "diag_bf16": (1e-2, False, 1, 64, 2, 12, torch.bfloat16, False, None),
    "iso_bf16": (1e-2, True, 1, 64, 2, 12, torch.bfloat16, False, None),
}
for name, (tol, iso, B, T, H, K, dtype, dplr, seg) in cases.items():
    segments[name], errs = gain_case(iso, B, T, H, K, dtype, dplr, seg)
    out[name] = (tol, errs)

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
print(json.dumps({"errors": out, "segments": segments}))
"""


def test_triton_kernels_in_interpreter_match_reference() -> None:
    report = triton_interpret.run_interpreted(SCRIPT, timeout=300)
    results = report["errors"]
    assert len(results) == 9
    for variant, (tol, errs) in results.items():
        assert max(errs.values()) < tol, (variant, errs)
    # the forced segments really split the sequence (3 segments, the last partial); the others do not
    assert report["segments"] == {"diag_seg32": 3, "diag_one_segment": 1, "diag_dplr_K72_seg32": 3, "iso_seg32": 3,
                                  "iso_one_segment": 1, "diag_bf16": 1, "iso_bf16": 1}


def test_segment_rule() -> None:
    """``(chunks per segment, segments)``: >= 512 programs where the sequence allows, >= 8 chunks a segment."""
    from kdn import triton_ops

    assert triton_ops._segments(64, 8192, 16) == (64, 8)  # B=4, H=16, T=8K, K=128: 512 programs
    assert triton_ops._segments(64, 8192, 32) == (32, 8)  # the Isotropic chunk
    assert triton_ops._segments(16, 32768, 16) == (64, 32)  # B=1, T=32K
    assert triton_ops._segments(64, 8200, 16) == (65, 8)  # T not a multiple of the chunk
    assert triton_ops._segments(2, 100, 16) == (8, 1)  # short sequences: one segment
    assert triton_ops._segments(2, 4096, 16) == (8, 32)
    triton_ops._SEG_OVERRIDE = 24
    try:
        with pytest.raises(ValueError, match="multiple of the chunk size 16"):
            triton_ops._segments(2, 100, 16)
    finally:
        triton_ops._SEG_OVERRIDE = None
