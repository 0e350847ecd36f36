"""``kdn.ops.triton.intra.chunk_asym_bwd_intra`` on the CPU through Triton's interpreter
(``tests/triton_interpret.py``), against fla's ``chunk_precond_kda_bwd_intra`` on the same FP32 inputs, with its
safe-gate path and its token loop: all five outputs to 1e-5 (relative), with T not a multiple of the chunk, one and
several key blocks (K not a multiple of the block), packed sequences, gates falling slowly and fast, and ``dg`` per
token (summed here by fla's ``chunk_local_cumsum``). A control shows that the comparison catches a transposed
``dAqk``. The choice between the kernels (``KDN_INTRA_KERNEL``) and its one-line errors are checked without the
interpreter."""
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
triton_interpret.enable("fla.ops.precond_kda.chunk_intra", "fla.ops.utils")
from fla.ops.precond_kda.chunk_intra import chunk_precond_kda_bwd_intra
from fla.ops.utils import chunk_local_cumsum, prepare_chunk_indices
from fla.ops.utils.constant import RCP_LN2
from kdn.ops.triton.intra import chunk_asym_bwd_intra
from kdn_inputs import rel_err

BT = 64
NAMES = ("dq", "dk", "dkp", "db", "dg")


def inputs(B, T, H, K, cu, decay, seed):
    gen = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen)
    x = {n: rnd(B, T, H, K) for n in ("q", "k", "k_precond", "dq", "dk", "dk_precond", "dg")}
    x["g"] = chunk_local_cumsum(-F.softplus(rnd(B, T, H, K)) * decay, chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu)
    x["beta"] = torch.rand(B, T, H, generator=gen) + 0.1
    x["db"] = rnd(B, T, H)
    x["dAqk"], x["dAkk"] = rnd(B, T, H, BT), rnd(B, T, H, BT)
    return x


out = {}
cases = {  # B, T, H, K, cu_seqlens, decay, block_k, dg summed
    "T77_K32": (2, 77, 2, 32, None, 0.3, 32, True),
    "T77_K64_bk32_fast": (1, 77, 1, 64, None, 2.0, 32, True),
    "T64_K96_bk64_pertoken": (1, 64, 1, 96, None, 0.3, 64, False),
    "varlen_K32": (1, 130, 2, 32, torch.tensor([0, 40, 100, 101, 130]), 1.0, 32, True),
}
for name, (B, T, H, K, cu, decay, bk, sums) in cases.items():
    x = inputs(B, T, H, K, cu, decay, seed=T + K)
    ci = None if cu is None else prepare_chunk_indices(cu, BT)
    ours = chunk_asym_bwd_intra(**x, cu_seqlens=cu, chunk_indices=ci, block_k=bk, dg_chunk_sums=sums)
    if not sums:
        ours = (*ours[:4], chunk_local_cumsum(ours[4], chunk_size=BT, reverse=True, cu_seqlens=cu, chunk_indices=ci))
    for safe in (True, False):
        ref = chunk_precond_kda_bwd_intra(**x, cu_seqlens=cu, chunk_indices=ci, chunk_size=BT, safe_gate=safe)
        assert [(o.shape, o.dtype) for o in ours] == [(r.shape, r.dtype) for r in ref]
        out[f"{name}_{'safe' if safe else 'loop'}"] = {n: rel_err(o, r) for n, o, r in zip(NAMES, ours, ref)}

# control: fla given dAqk with its chunk blocks transposed
x = inputs(1, 64, 1, 32, None, 0.3, seed=1)
ours = chunk_asym_bwd_intra(**x)
bad = x["dAqk"].view(1, 1, BT, 1, BT).transpose(2, 4).reshape(1, 64, 1, BT).contiguous()
ref = chunk_precond_kda_bwd_intra(**(x | {"dAqk": bad}), chunk_size=BT, safe_gate=True)
out["control_dAqk_transposed"] = {n: rel_err(o, r) for n, o, r in zip(NAMES, ours, ref)}
print(json.dumps(out))
"""


def test_intra_bwd_in_interpreter_matches_fla() -> None:
    errs = triton_interpret.run_interpreted(SCRIPT)
    control = errs.pop("control_dAqk_transposed")
    assert len(errs) == 8
    for case, e in errs.items():
        assert max(e.values()) <= 1e-5, (case, e)
    assert min(control[n] for n in ("dq", "dkp", "dg")) > 0.1, control


def test_intra_kernel_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    from kdn.ops.triton.memory import intra_kernel

    cpu = (torch.randn(1, 64, 1, 32),)  # no TMA off CUDA: auto takes the pointer kernel
    monkeypatch.delenv("KDN_INTRA_KERNEL", raising=False)
    assert intra_kernel(True, cpu) == "kdn" and intra_kernel(False, cpu) == "fla"
    assert intra_kernel(True, cpu, "fla") == "fla" and intra_kernel(True, cpu, "kdn") == "kdn"
    monkeypatch.setenv("KDN_INTRA_KERNEL", "fla")
    assert intra_kernel(True, cpu) == "fla"
    for forced in ("kdn", "tma"):
        monkeypatch.setenv("KDN_INTRA_KERNEL", forced)
        with pytest.raises(ValueError, match="not: set KDN_INTRA_KERNEL=auto"):
            intra_kernel(False, cpu)
    with pytest.raises(ValueError, match="sm_90 .* set KDN_INTRA_KERNEL=auto"):
        intra_kernel(True, cpu)
    monkeypatch.setenv("KDN_INTRA_KERNEL", "tilelang")
    with pytest.raises(ValueError, match="is not one of .* set KDN_INTRA_KERNEL"):
        intra_kernel(True, cpu)


def test_intra_rejects_other_chunks() -> None:
    import torch

    from kdn.ops.triton.intra import chunk_asym_bwd_intra

    x = torch.randn(1, 64, 1, 32)
    with pytest.raises(ValueError, match="chunks of 64 rows, got 32: pass chunk_size=64"):
        chunk_asym_bwd_intra(x, x, x, x, x[..., 0], x, x, x, x, x, x[..., 0], x, chunk_size=32)
    with pytest.raises(ValueError, match="need chunk_indices"):
        chunk_asym_bwd_intra(x, x, x, x, x[..., 0], x, x, x, x, x, x[..., 0], x, cu_seqlens=torch.tensor([0, 64]))
