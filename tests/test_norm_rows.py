"""``kdn.modules.front_end.by_rows``: fla's row-wise norms called on pieces of at most ``NORM_ROWS`` rows when no
gradient is needed (so that their autotuning, keyed on a call's rows, runs once for prompts of every size), with the
same output as one call; one call when gradients are needed. fla's kernels themselves run split and whole through
Triton's interpreter on the CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kdn.modules.front_end import NORM_ROWS, by_rows


def recording(calls: list[int]):  # noqa: ANN201
    def fn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        calls.append(a.shape[0] if a.dim() == 2 else a.numel() // a.shape[-1])
        return F.normalize(a, dim=-1) * torch.sigmoid(b)
    return fn


def test_pieces_without_gradients_give_one_calls_output() -> None:
    x, g = torch.randn(3, 50, 4, 16), torch.randn(3, 50, 4, 16)  # 600 rows
    calls: list[int] = []
    with torch.no_grad():
        out = by_rows(recording(calls), x, g, rows=128)
    assert calls == [128, 128, 128, 128, 88]
    assert out.shape == x.shape and torch.equal(out, F.normalize(x, dim=-1) * torch.sigmoid(g))


def test_one_call_with_gradients_or_when_the_rows_fit() -> None:
    x, g = torch.randn(600, 16, requires_grad=True), torch.randn(600, 16)
    calls: list[int] = []
    by_rows(recording(calls), x, g, rows=128).sum().backward()
    assert calls == [600] and x.grad is not None
    with torch.no_grad():
        by_rows(recording(calls), x[:100], g[:100], rows=128)
    assert calls == [600, 100]
    assert NORM_ROWS == 2048 * 32  # fla's bucket of rows in its norms' autotune key (NB = cdiv(rows, 65536))


SCRIPT = r"""
import json, sys, torch
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.modules.norm.l2norm", "fla.modules.norm.fused_norm_gate")
from fla.modules.norm.l2norm import l2norm
from fla.modules.norm.fused_norm_gate import rms_norm_gated
from kdn.modules.front_end import by_rows

gen = torch.Generator().manual_seed(0)
x = torch.randn(2, 70, 3, 64, generator=gen).bfloat16()
g = torch.randn(2, 70, 3, 64, generator=gen).bfloat16()
w = 1 + 0.1 * torch.randn(64, generator=gen)
with torch.no_grad():
    l2 = [by_rows(lambda t: l2norm(t, eps=1e-12), x, rows=r) for r in (10**9, 96)]
    gated = [by_rows(lambda a, b: rms_norm_gated(a, b, w, None, activation="sigmoid", eps=1e-5), x, g, rows=r)
             for r in (10**9, 96)]
print(json.dumps({"l2": torch.equal(*l2), "gated": torch.equal(*gated),
                  "l2_ref": (l2[0].float() - torch.nn.functional.normalize(x.float(), dim=-1)).abs().max().item()}))
"""


def test_fla_norms_split_by_rows_equal_one_call_in_interpreter() -> None:
    triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py
    out = triton_interpret.run_interpreted(SCRIPT)
    assert out["l2"] and out["gated"], out
    assert out["l2_ref"] < 1e-2  # fla's l2norm ran (bf16 rounding of the normalised rows)


@pytest.mark.gpu
def test_fla_norms_split_by_rows_on_cuda() -> None:
    from fla.modules.norm.fused_norm_gate import rms_norm_gated
    from fla.modules.norm.l2norm import l2norm

    rows = 2 * NORM_ROWS + 777  # three pieces, one autotune bucket (fla's configs may differ from one call's)
    x = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(rows, 128, device="cuda", dtype=torch.bfloat16)
    w = 1 + 0.1 * torch.randn(128, device="cuda")
    with torch.no_grad():
        pairs = [(by_rows(lambda t: l2norm(t, eps=1e-12), x), l2norm(x, eps=1e-12)),
                 (by_rows(lambda a, b: rms_norm_gated(a, b, w, None, activation="sigmoid"), x, g),
                  rms_norm_gated(x, g, w, None, activation="sigmoid"))]
    for split, whole in pairs:
        assert ((split.float() - whole.float()).norm() / whole.float().norm()).item() < 1e-3
