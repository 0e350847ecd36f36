"""The Triton kernels (fused gains forward and backward, fused recurrent decoding) on the CPU, through Triton's
interpreter.

``TRITON_INTERPRET=1`` must be set before ``kdn.triton_ops`` is imported, so the checks run in a fresh
interpreter. Gains are compared in FP32 with the float64 PyTorch reference (``kdn.gain``): value, final
uncertainty and the gradient of every input (``mu`` and the initial uncertainty included). Sizes cross the
Isotropic kernels' chunk boundaries (32 tokens), ``K`` is not a power of two, some tokens
forget strongly (``g`` down to -12). Small forced segments (``triton_ops._SEG_OVERRIDE``) run the sequence-
parallel path: 4 Diagonal segments of 24 tokens and 3 Isotropic ones of a chunk, the last partial; by the
default rule the Diagonal cases have segments of 64 tokens (2 here), the Isotropic ones a single segment.
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


def gain_case(iso, B, T, H, K, dtype, dplr=False, seg=None, softplus=False):
    # float64 reference on the same (dtype-rounded) key; every input a leaf; seg: tokens per segment; softplus:
    # omega given before its softplus (real values of both signs, some far below 0), applied in the kernels
    triton_ops._SEG_OVERRIDE = seg
    ns = triton_ops.gain_segments(iso, B * H, T)[1]
    x = make_inputs(B, T, H, K, K, isotropic=iso, seed=T + K, g_min=-3.0)
    x["g"][:, T // 2:T // 2 + 4] *= 4.0  # strong forgetting: g down to -12
    x["k"] = x["k"].to(dtype).double()
    if softplus:
        x["omega"] = torch.randn(x["omega"].shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64) * 3
        x["omega"][:, :5] -= 20.0
    u0 = make_state(B, H, K, K, isotropic=iso)[1]
    mu = torch.linspace(1.0, float(K), H, dtype=torch.float64)
    l64 = {n: x[n].clone().requires_grad_() for n in ("k", "g", "omega", "r")}
    l64 |= {"mu": mu.requires_grad_(), "u0": u0.requires_grad_()}
    l32 = {n: t.detach().float().requires_grad_() for n, t in l64.items()}
    l32["k"] = l64["k"].detach().to(dtype).requires_grad_()
    args64 = [l64[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    args32 = [l32[n] for n in ("k", "g", "omega", "r", "mu", "u0")]
    kw = {"omega_softplus": True} if softplus else {}
    if softplus:
        args64[2] = torch.nn.functional.softplus(args64[2])
    if iso:
        outs64 = ref.isotropic_gain(*args64)
        outs32 = triton_ops.isotropic_gain(*args32, out_dtype=dtype)
    elif dplr:
        kappa, pT = ref.diagonal_gain(*args64)
        outs64 = (kappa, l64["g"].exp() * l64["k"], -kappa, pT)
        outs32 = triton_ops.diagonal_gain_dplr(*args32, out_dtype=dtype, **kw)
    else:
        outs64 = ref.diagonal_gain(*args64)
        outs32 = triton_ops.diagonal_gain(*args32, out_dtype=dtype, **kw)
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
cases = {  # name: (tolerance, iso, B, T, H, K, dtype, dplr, tokens per segment[, omega before its softplus])
    "diag_seg24": (1e-5, False, 2, 77, 3, 12, torch.float32, False, 24),
    "diag_default_seg": (1e-5, False, 2, 77, 3, 12, torch.float32, False, None),
    "diag_dplr_K72_seg24": (1e-5, False, 1, 77, 2, 72, torch.float32, True, 24),
    "diag_dplr_softplus_seg24": (1e-5, False, 2, 77, 3, 12, torch.float32, True, 24, True),
    "iso_seg32": (1e-5, True, 2, 77, 3, 12, torch.float32, False, 32),
    "iso_one_segment": (1e-5, True, 2, 77, 3, 12, torch.float32, False, None),
    "diag_bf16": (1e-2, False, 1, 64, 2, 12, torch.bfloat16, False, None),
    "iso_bf16": (1e-2, True, 1, 64, 2, 12, torch.bfloat16, False, None),
}
for name, (tol, *case) in cases.items():
    segments[name], errs = gain_case(*case)
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
    assert len(results) == 10
    for variant, (tol, errs) in results.items():
        assert max(errs.values()) < tol, (variant, errs)
    # the forced segments really split the sequence (the last partial); the others do not
    assert report["segments"] == {"diag_seg24": 4, "diag_default_seg": 2, "diag_dplr_K72_seg24": 4,
                                  "diag_dplr_softplus_seg24": 4, "iso_seg32": 3, "iso_one_segment": 1,
                                  "diag_bf16": 1, "iso_bf16": 1}


def test_segment_rule() -> None:
    """``(tokens per segment, segments)``. Isotropic: >= 512 programs where the sequence allows, >= 8 chunks of 32
    tokens a segment; Diagonal (one warp a program): >= 4096 programs, >= 64 tokens a segment."""
    from kdn import triton_ops

    assert triton_ops.gain_segments(True, 64, 8192) == (1024, 8)  # B=4, H=16, T=8K: 512 programs
    assert triton_ops.gain_segments(True, 64, 8200) == (1056, 8)  # T not a multiple of the chunk
    assert triton_ops.gain_segments(True, 2, 100) == (256, 1)  # short sequences: one segment
    assert triton_ops.gain_segments(False, 64, 8192) == (128, 64)  # 4096 programs
    assert triton_ops.gain_segments(False, 16, 32768) == (128, 256)  # B=1, T=32K
    assert triton_ops.gain_segments(False, 64, 8200) == (129, 64)
    assert triton_ops.gain_segments(False, 2, 100) == (64, 2)
    triton_ops._SEG_OVERRIDE = 24
    try:
        assert triton_ops.gain_segments(False, 2, 100) == (24, 5)
        with pytest.raises(ValueError, match="multiple of the chunk size 32"):
            triton_ops.gain_segments(True, 2, 100)
    finally:
        triton_ops._SEG_OVERRIDE = None
