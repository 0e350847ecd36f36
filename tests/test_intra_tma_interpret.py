"""``kdn.ops.triton.intra_tma.chunk_asym_bwd_intra_tma`` (tiles through tensor descriptors) on the CPU through
Triton's interpreter (``tests/triton_interpret.py``), against ``kdn.ops.triton.intra.chunk_asym_bwd_intra`` (checked
against fla in ``tests/test_intra_interpret.py``) on the same inputs: all five outputs to 1e-5 (relative), with T not
a multiple of the chunk, one and several key blocks, K not a multiple of the block, packed sequences (a one-token
one among them; partial chunks stored through in-kernel descriptors; the chunks taken in reverse order, so that a
store past a sequence's end would show), gates falling slowly and fast, ``dg`` per token and summed, and bf16
``q, k, k_precond`` as training passes them. A control shows that the comparison catches a transposed ``dAqk``. The
one-line errors (rows not a multiple of 16 bytes, other chunks) are checked without the interpreter."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch
import torch.nn.functional as F
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.utils")
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from kdn.ops.triton.intra import chunk_asym_bwd_intra
from kdn.ops.triton.intra_tma import chunk_asym_bwd_intra_tma
from kdn_inputs import rel_err

BT = 64
NAMES = ("dq", "dk", "dkp", "db", "dg")


def inputs(B, T, H, K, cu, decay, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    x = {n: rnd(B, T, H, K).to(dtype) for n in ("q", "k", "k_precond")}
    x |= {n: rnd(B, T, H, K) for n in ("dq", "dk", "dk_precond", "dg")}
    x["g"] = chunk_local_cumsum(-F.softplus(rnd(B, T, H, K)) * decay, chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu)
    x["beta"] = torch.rand(B, T, H, generator=gen) + 0.1
    x["db"] = rnd(B, T, H)
    x["dAqk"], x["dAkk"] = rnd(B, T, H, BT), rnd(B, T, H, BT)
    return x


f32, bf16 = torch.float32, torch.bfloat16
out = {}
cases = {  # B, T, H, K, cu_seqlens, decay, block_k, dg summed, dtype of q, k, k_precond
    "T77_K32": (2, 77, 2, 32, None, 0.3, 32, True, f32),
    "T77_K64_bk32_fast": (1, 77, 1, 64, None, 2.0, 32, True, f32),
    "T64_K96_bk64_pertoken": (1, 64, 1, 96, None, 0.3, 64, False, f32),
    "T70_K20_bk16": (1, 70, 1, 20, None, 0.3, 16, True, f32),
    "varlen_K32": (1, 130, 2, 32, torch.tensor([0, 40, 100, 101, 130]), 1.0, 32, True, f32),
    "varlen_K96_bk64_pertoken": (1, 150, 1, 96, torch.tensor([0, 1, 70, 150]), 0.5, 64, False, f32),
    "T100_K64_bf16": (1, 100, 2, 64, None, 0.3, 64, True, bf16),
}
for name, (B, T, H, K, cu, decay, bk, sums, dtype) in cases.items():
    x = inputs(B, T, H, K, cu, decay, T + K, dtype)
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    kw = dict(cu_seqlens=cu, chunk_indices=ci, block_k=bk, dg_chunk_sums=sums)
    ref = chunk_asym_bwd_intra(**x, **kw)
    # packed chunks in reverse order: a partial chunk that stored past its sequence would overwrite the next one's
    # rows after they were written (the interpreter runs the programs in order)
    ours = chunk_asym_bwd_intra_tma(**x, **(kw if ci is None else kw | {"chunk_indices": ci.flip(0)}))
    assert [(o.shape, o.dtype) for o in ours] == [(r.shape, r.dtype) for r in ref]
    # bf16 outputs: the reference's rounding of the same FP32 sums, compared in FP32
    out[name] = {n: rel_err(o.float(), r.float()) for n, o, r in zip(NAMES, ours, ref)}

# control: ours given dAqk with its chunk blocks transposed
x = inputs(1, 64, 1, 32, None, 0.3, 1, f32)
bad = x["dAqk"].view(1, 1, BT, 1, BT).transpose(2, 4).reshape(1, 64, 1, BT).contiguous()
ours, ref = chunk_asym_bwd_intra_tma(**(x | {"dAqk": bad})), chunk_asym_bwd_intra(**x)
out["control_dAqk_transposed"] = {n: rel_err(o, r) for n, o, r in zip(NAMES, ours, ref)}
print(json.dumps(out))
"""


def test_intra_tma_in_interpreter_matches_intra() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT, timeout=90)
    control = errs.pop("control_dAqk_transposed")
    assert len(errs) == 7
    for case, e in errs.items():
        assert max(e.values()) <= 1e-5, (case, e)
    assert min(control[n] for n in ("dq", "dkp", "dg")) > 0.1, control


def test_intra_tma_rejects_unaligned_rows_and_other_chunks() -> None:
    import torch

    from kdn.ops.triton.intra_tma import chunk_asym_bwd_intra_tma

    x = torch.randn(1, 64, 1, 18)
    with pytest.raises(ValueError, match="K=18 in float32 is not: pad K to a multiple of 4 or use chunk_asym_bwd_int"):
        chunk_asym_bwd_intra_tma(x, x, x, x, x[..., 0], x, x, x, x, x, x[..., 0], x)
    y = torch.randn(1, 64, 1, 36).bfloat16()
    z = torch.randn(1, 64, 1, 36)
    with pytest.raises(ValueError, match="K=36 in bfloat16 is not: pad K to a multiple of 8"):
        chunk_asym_bwd_intra_tma(y, y, y, z, z[..., 0], z, z, z, z, z, z[..., 0], z)
    x = torch.randn(1, 64, 1, 32)
    with pytest.raises(ValueError, match="chunks of 64 rows, got 32: pass chunk_size=64"):
        chunk_asym_bwd_intra_tma(x, x, x, x, x[..., 0], x, x, x, x, x, x[..., 0], x, chunk_size=32)
    with pytest.raises(ValueError, match="need chunk_indices"):
        chunk_asym_bwd_intra_tma(x, x, x, x, x[..., 0], x, x, x, x, x, x[..., 0], x, cu_seqlens=torch.tensor([0, 64]))
