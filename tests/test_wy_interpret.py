"""``kdn.ops.triton.wy.chunk_asym_bwd_wy_dqkg`` on the CPU through Triton's interpreter (``tests/triton_interpret.py``),
against fla's ``chunk_precond_kda_bwd_wy_dqkg`` on the same FP32 inputs: all seven outputs to 1e-5 (relative), with
T not a multiple of the chunk, several K-blocks (their shares of dA and db summed; K not a multiple of BK), several
V-blocks, and packed sequences. The interpreter runs each autotuner's first config; the cases choose it (``BV``).
A control shows that the comparison catches a transposed operand: fla's outputs with ``A``'s chunk blocks or the
states transposed are far from ours."""
from __future__ import annotations

import pytest

pytest.importorskip("triton")
pytest.importorskip("fla")
triton_interpret = pytest.importorskip("triton_interpret")  # tests/triton_interpret.py

SCRIPT = r"""
import json, sys, torch, triton
import torch.nn.functional as F
sys.path.insert(0, "tests")
import triton_interpret
triton_interpret.enable("fla.ops.precond_kda.chunk_bwd", "fla.ops.utils")
from fla.ops.precond_kda.chunk_bwd import chunk_precond_kda_bwd_wy_dqkg
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from kdn.ops.triton import wy as triton_wy
from kdn_inputs import rel_err

NAMES = ("dq", "dk", "dkg", "dv2", "db", "dg", "dA")
BT = 64


def inputs(B, T, H, K, V, cu, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    NT = B * (triton.cdiv(T, BT) if cu is None else len(prepare_chunk_indices(cu, BT)))
    x = {n: rnd(B, T, H, K) for n in ("q", "k", "k_precond")} | {n: rnd(B, T, H, V) for n in ("v", "v_new", "do", "dv")}
    x["g"] = chunk_local_cumsum(-F.softplus(rnd(B, T, H, K)) * 0.3, chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu)
    x["beta"] = torch.rand(B, T, H, generator=gen) + 0.1
    tril = torch.ones(BT, BT).tril()[(torch.arange(T) % BT) if cu is None else _rows(cu)][None, :, None]
    x["A"] = rnd(B, T, H, BT) * (0.3 * tril + 0.05)  # lower triangular and a little above
    x["h"], x["dh"] = rnd(B, NT // B, H, K, V) * 0.5, rnd(B, NT // B, H, K, V) * 0.5
    return x


def _rows(cu):  # each packed row's position within its chunk
    pos = torch.cat([torch.arange(int(e - s)) for s, e in zip(cu[:-1], cu[1:])])
    return pos % BT


def transpose_chunks(A):  # A's [BT, BT] chunk blocks transposed (T a multiple of BT)
    B, T, H, _ = A.shape
    return A.view(B, T // BT, BT, H, BT).transpose(2, 4).reshape(B, T, H, BT)


CONFIGS = {kernel: list(kernel.configs) for kernel in (triton_wy._dqkg_kernel, triton_wy._dA_kernel)}


def use(kernel, **kw):  # the interpreter keeps each autotuner's first config
    kernel.configs = sorted(CONFIGS[kernel], key=lambda c: any(c.kwargs[n] != v for n, v in kw.items()))


out = {}
cases = {  # B, T, H, K, V, cu_seqlens, BV of each kernel (BK = min(64, K))
    "T77_K32_V32": (2, 77, 2, 32, 32, None, 32, 32),
    "T130_K128_V32": (1, 130, 1, 128, 32, None, 32, 32),
    "T77_K96_V64": (2, 77, 1, 96, 64, None, 32, 64),
    "varlen_K32_V64": (1, 130, 2, 32, 64, torch.tensor([0, 40, 100, 130]), 64, 32),
}
for name, (B, T, H, K, V, cu, bv, bv2) in cases.items():
    use(triton_wy._dqkg_kernel, BV=bv)
    use(triton_wy._dA_kernel, BV=bv2)
    x = inputs(B, T, H, K, V, cu, seed=T + K + V)
    ref = chunk_precond_kda_bwd_wy_dqkg(**x, scale=0.37, cu_seqlens=cu, chunk_size=BT)
    ours = triton_wy.chunk_asym_bwd_wy_dqkg(**x, scale=0.37, cu_seqlens=cu, chunk_size=BT)
    assert (triton_wy._dqkg_kernel.best_config.kwargs["BV"], triton_wy._dA_kernel.best_config.kwargs["BV"]) == (bv, bv2)
    assert [(o.shape, o.dtype) for o in ours] == [(r.shape, r.dtype) for r in ref]
    out[name] = {n: rel_err(o, r) for n, o, r in zip(NAMES, ours, ref)}

# control: the same comparison against fla given a transposed operand
x = inputs(1, 128, 1, 32, 32, None, seed=1)
ours = triton_wy.chunk_asym_bwd_wy_dqkg(**x, scale=0.37, chunk_size=BT)
for name, bad in {"A": transpose_chunks(x["A"]), "h": x["h"].transpose(-1, -2).contiguous()}.items():
    ref = chunk_precond_kda_bwd_wy_dqkg(**(x | {name: bad}), scale=0.37, chunk_size=BT)
    out[f"control_{name}_transposed"] = {n: rel_err(o, r) for n, o, r in zip(NAMES, ours, ref)}
print(json.dumps(out))
"""


def test_wy_dqkg_in_interpreter_matches_fla() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT)
    controls = {case: errs.pop(case) for case in ("control_A_transposed", "control_h_transposed")}
    assert set(errs) == {"T77_K32_V32", "T130_K128_V32", "T77_K96_V64", "varlen_K32_V64"}
    for case, e in errs.items():
        assert max(e.values()) <= 1e-5, (case, e)
    for case, e in controls.items():  # the comparison would catch either mistake
        assert max(e.values()) > 0.1, (case, e)
