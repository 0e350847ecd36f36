"""The fused residual add + RMSNorm (``kdn.modules.norm``) on the CPU through Triton's interpreter, against float64:
the normed output, the new FP32 stream and the gradients of the sublayer output, the stream and the weight, with
and without an incoming stream, with the stream's gradient and without it, ``D`` not a power of two and the rows
not a multiple of the backward's ``ROWS``. FP32 end to end must match to 1e-6; bf16 outputs to their rounding."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.lean_device_calls()
from kdn.modules.norm import add_rms_norm
from kdn_inputs import rel_err

F32, BF16 = torch.float32, torch.bfloat16
out = {}
gen = torch.Generator().manual_seed(0)
cases = {  # shape, sublayer output dtype, weight dtype, incoming stream, stream gradient
    "fp32_first": ((150, 64), F32, F32, False, True),
    "fp32_later": ((2, 70, 48), F32, F32, True, True),
    "bf16_later": ((2, 75, 48), BF16, F32, True, True),
    "bf16_weight_no_stream_grad": ((3, 70, 40), BF16, BF16, True, False),
}
for name, (shape, x_dt, w_dt, has_s, s_grad) in cases.items():
    x = torch.randn(*shape, generator=gen).to(x_dt)
    s = torch.randn(*shape, generator=gen) * 3 if has_s else None
    w = (1 + 0.3 * torch.randn(shape[-1], generator=gen)).to(w_dt)
    wy, ws = torch.randn(*shape, generator=gen), torch.randn(*shape, generator=gen)
    leaves = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, s, w)]
    y, r = add_rms_norm(*leaves, 1e-5)
    assert (y.dtype, r.dtype) == (x_dt, F32), (y.dtype, r.dtype)
    ((y.double() * wy).sum() + ((r.double() * ws).sum() if s_grad else 0)).backward()
    ref = [t.detach().double().requires_grad_() if t is not None else None for t in (x, s, w)]
    r64 = ref[0] + ref[1] if has_s else ref[0]
    y64 = r64 * torch.rsqrt(r64.pow(2).mean(-1, keepdim=True) + 1e-5) * ref[2]
    ((y64 * wy).sum() + ((r64 * ws).sum() if s_grad else 0)).backward()
    assert leaves[0].grad.dtype == x_dt and leaves[2].grad.dtype == w_dt
    e = {"y": rel_err(y, y64), "stream": rel_err(r, r64), "dx": rel_err(leaves[0].grad, ref[0].grad),
         "dw": rel_err(leaves[2].grad, ref[2].grad)}
    if has_s:
        e["dstream"] = rel_err(leaves[1].grad, ref[1].grad)
    out[name] = e
print(json.dumps(out))
"""


def test_add_rms_norm_in_interpreter_matches_float64() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT)
    assert set(errs) == {"fp32_first", "fp32_later", "bf16_later", "bf16_weight_no_stream_grad"}
    for case, e in errs.items():
        tol = 1e-6 if case.startswith("fp32") else 1e-2
        assert max(e.values()) < tol, (case, e)


def test_add_rms_norm_rejects_bad_operands() -> None:
    import torch

    from kdn.modules.norm import add_rms_norm

    x = torch.randn(2, 5, 8)
    with pytest.raises(ValueError, match="residual must be FP32 with x's shape"):
        add_rms_norm(x, torch.randn(2, 5, 8, dtype=torch.float64), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match="residual must be FP32 with x's shape"):
        add_rms_norm(x, torch.randn(2, 4, 8), torch.ones(8), 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \(8,\)"):
        add_rms_norm(x, None, torch.ones(7), 1e-5)
