"""The intra-chunk backward, both of ours (``kdn.ops.triton.intra_tma.chunk_asym_bwd_intra_tma``, tiles by tensor
descriptors, the default on sm_90; ``kdn.ops.triton.intra.chunk_asym_bwd_intra``, by pointers) and fla's kernel they
replace, all against
a float64 autograd reference of the chunk blocks ``Aqk, Akk`` on the same inputs (bf16 ``q, k, kp``; FP32 gates and
incoming gradients, as the memory's backward passes them): every output (``dq, dk, dkp, db, dg``) within ``TOL``,
and the bf16 outputs within ``RATIO`` times fla's error plus 1e-5. Shapes: T a multiple of the chunk and not, K of 64
and 128, packed sequences with chunks cut short (one of a single token), key blocks of 32 and 64, gates falling
slowly and fast, ``dg`` summed within the chunk and per token, and the TF32x3 copies (FP32 inputs) against float64.
Each case also writes its errors to ``$KDN_ACCURACY_JSON`` (JSON lines) when set."""
from __future__ import annotations

import json
import math
import os
from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BT = 64
NAMES = ("dq", "dk", "dkp", "db", "dg")
# Measured on an H100 (docs/results/accuracy.md, "The intra-chunk backward in one program per chunk"), at most:
# dq, dk, dkp 1.72e-3 for both kernels (their bf16 rounding; ours within 1.03x fla's); db 7.7e-4 and dg 2.7e-4 here
# against fla's 2.3e-4 and 7.6e-5: fla's diagonal blocks run at bf16x3 where ours run at TF32, so db and dg are held
# to a tolerance, not to fla's error.
TOL = {"dq": 4e-3, "dk": 4e-3, "dkp": 4e-3, "db": 2e-3, "dg": 6e-4}
RATIO = {"dq": 1.1, "dk": 1.1, "dkp": 1.1}


def make_inputs(B: int, T: int, H: int, K: int, cu: list[int] | None, decay: float, dtype: torch.dtype,
                seed: int) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Random inputs (never zeros) on CUDA: ``q, k, k_precond`` in ``dtype``, the rest FP32; ``g`` the chunk-local
    cumulative sum of ``-decay * softplus(N(0, 1))`` nats per token, in log2 units. Returns the inputs and those
    per-token gates (nats)."""
    from fla.ops.utils import chunk_local_cumsum
    from fla.ops.utils.constant import RCP_LN2

    gen = torch.Generator().manual_seed(seed)

    def rnd(*s: int) -> torch.Tensor:
        return torch.randn(*s, generator=gen).cuda()

    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    x = {n: rnd(B, T, H, K).to(dtype) for n in ("q", "k", "k_precond")}
    x |= {n: rnd(B, T, H, K) for n in ("dq", "dk", "dk_precond", "dg")}
    gate = -torch.nn.functional.softplus(rnd(B, T, H, K)) * decay
    x["g"] = chunk_local_cumsum(gate, chunk_size=BT, scale=RCP_LN2, cu_seqlens=cu_t)
    x["beta"] = torch.rand(B, T, H, generator=gen).cuda() + 0.1
    x["db"] = rnd(B, T, H)
    x["dAqk"], x["dAkk"] = rnd(B, T, H, BT) * 0.3, rnd(B, T, H, BT) * 0.3
    return x, gate


def reference(x: dict[str, torch.Tensor], cu: list[int] | None, dg_chunk_sums: bool) -> dict[str, torch.Tensor]:
    """The five outputs in float64: autograd of ``sum(dAqk Aqk) + sum(dAkk Akk)`` chunk by chunk (module docstring of
    :mod:`kdn.ops.triton.intra`; both blocks on and below the diagonal, as fla's kernel reads them), plus the
    incoming gradients; ``dg`` of the gate in nats, summed to the chunk's end when ``dg_chunk_sums``."""
    d = {n: t.double() for n, t in x.items()}
    B, T, H, K = d["k"].shape
    out = {"dq": d["dq"].clone(), "dk": d["dk"].clone(), "dkp": d["dk_precond"].clone(), "db": d["db"].clone(),
           "dg": d["dg"].clone()}
    seqs = [(b, 0, T) for b in range(B)] if cu is None else [(0, s, e) for s, e in zip(cu[:-1], cu[1:])]
    for b, s, e in seqs:
        for c0 in range(s, e, BT):
            r = slice(c0, min(c0 + BT, e))
            n = r.stop - r.start
            q, k, kp = (d[m][b, r].requires_grad_() for m in ("q", "k", "k_precond"))  # [n, H, K]
            G = (d["g"][b, r] * math.log(2)).requires_grad_()  # nats
            beta = d["beta"][b, r].requires_grad_()  # [n, H]
            lower = torch.ones(n, n, dtype=torch.bool, device=q.device).tril()[:, :, None, None]
            decay = torch.exp(torch.where(lower, G[:, None] - G[None, :], -math.inf))  # [t, s, H, K]
            aqk = torch.einsum("thk,shk,tshk->ths", q, kp, decay)
            akk = torch.einsum("thk,shk,tshk->ths", k, kp, decay) * beta[:, :, None]
            loss = (aqk * d["dAqk"][b, r, :, :n]).sum() + (akk * d["dAkk"][b, r, :, :n]).sum()
            grads = torch.autograd.grad(loss, (q, k, kp, beta, G))
            for m, grad in zip(NAMES, grads):
                out[m][b, r] += grad
    if dg_chunk_sums:
        for b, s, e in seqs:
            for c0 in range(s, e, BT):
                r = slice(c0, min(c0 + BT, e))
                out["dg"][b, r] = out["dg"][b, r].flip(0).cumsum(0).flip(0)
    return out


def fla_intra(x: dict[str, torch.Tensor], cu_t: torch.Tensor | None, ci: torch.Tensor | None,
              dg_chunk_sums: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[torch.Tensor, ...]:
    """fla's kernel through the memory's fla path (safe gate)."""
    from kdn.ops.triton.memory import _asym_intra_bwd

    with monkeypatch.context() as m:
        m.setenv("KDN_INTRA_KERNEL", "fla")
        return _asym_intra_bwd(x["q"], x["k"], x["k_precond"], x["g"], x["beta"], x["dAqk"], x["dAkk"], x["dq"],
                               x["dk"], x["dk_precond"], x["db"], x["dg"], True,
                               {"cu_seqlens": cu_t, "chunk_indices": ci}, False, dg_chunk_sums)


CASES = [  # B, T, H, K, cu_seqlens, decay (nats per token, times softplus), block_k, dg_chunk_sums
    (2, 256, 4, 128, None, 0.3, 32, True),
    (1, 200, 2, 64, None, 0.3, 64, True),
    (3, 130, 3, 128, None, 1.0, 32, False),
    (1, 334, 3, 128, [0, 37, 101, 102, 230, 334], 0.3, 32, True),
    (1, 512, 2, 64, [0, 64, 320, 512], 1.0, 64, False),
    (2, 1024, 16, 128, None, 0.3, 64, True),
]


def _record(case: str, errs: dict[str, float], fla_errs: dict[str, float]) -> None:
    path = os.environ.get("KDN_ACCURACY_JSON")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": "intra_bwd", "case": case, "kdn": errs, "fla": fla_errs}) + "\n")


def launcher(kernel: str) -> Callable[..., tuple[torch.Tensor, ...]]:
    """Our intra-chunk backward by name: ``"tma"`` or ``"kdn"`` (pointers)."""
    from kdn.ops.triton.intra import chunk_asym_bwd_intra
    from kdn.ops.triton.intra_tma import chunk_asym_bwd_intra_tma

    return {"tma": chunk_asym_bwd_intra_tma, "kdn": chunk_asym_bwd_intra}[kernel]


@requires_cuda
@pytest.mark.parametrize("kernel", ["tma", "kdn"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"B{c[0]}T{c[1]}H{c[2]}K{c[3]}{'-packed' if c[4] else ''}"
                         f"-decay{c[5]}-bk{c[6]}{'' if c[7] else '-pertoken'}")
def test_intra_matches_float64(case: tuple, kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from fla.ops.utils import prepare_chunk_indices
    from kdn_inputs import rel_err

    from kdn.ops.triton.safe_gate import safe_gate

    B, T, H, K, cu, decay, block_k, sums = case
    x, gate = make_inputs(B, T, H, K, cu, decay, torch.bfloat16, seed=T + K)
    cu_t = None if cu is None else torch.tensor(cu, device="cuda")
    ci = None if cu is None else prepare_chunk_indices(cu_t, BT)
    assert bool(safe_gate(gate)), "the case's gates must be inside the safe envelope"
    ref = reference(x, cu, sums)
    ours = launcher(kernel)(**x, cu_seqlens=cu_t, chunk_indices=ci, dg_chunk_sums=sums, block_k=block_k)
    theirs = fla_intra(x, cu_t, ci, sums, monkeypatch)
    for name, o, r in zip(NAMES, ours, theirs):
        assert o.shape == r.shape and o.dtype == r.dtype, name
    errs = {n: rel_err(o, ref[n]) for n, o in zip(NAMES, ours)}
    fla_errs = {n: rel_err(o, ref[n]) for n, o in zip(NAMES, theirs)}
    _record(f"{kernel} {case[:-2]} bk{block_k} sums={sums}", errs, fla_errs)
    for n in NAMES:
        assert errs[n] < TOL[n] and errs[n] <= RATIO.get(n, float("inf")) * fla_errs[n] + 1e-5, (n, errs, fla_errs)


@requires_cuda
@pytest.mark.parametrize("kernel", ["tma", "kdn"])
def test_intra_precise_matches_float64(kernel: str) -> None:
    """The TF32x3 copies on FP32 inputs (the FP32 route) are FP32-accurate against float64 (within 1e-5)."""
    from fla.ops.utils import prepare_chunk_indices
    from kdn_inputs import rel_err

    from kdn.ops.triton.precision import precise_launcher

    cu = [0, 100, 333, 512]
    x, _ = make_inputs(1, 512, 2, 128, cu, 1.0, torch.float32, seed=7)
    cu_t = torch.tensor(cu, device="cuda")
    ours = precise_launcher(launcher(kernel))(**x, cu_seqlens=cu_t, chunk_indices=prepare_chunk_indices(cu_t, BT))
    ref = reference(x, cu, True)
    errs = {n: rel_err(o, ref[n]) for n, o in zip(NAMES, ours)}
    _record(f"{kernel} precise fp32 packed", errs, {})
    assert max(errs.values()) < 1e-5, errs


@requires_cuda
def test_intra_auto_takes_tma_on_sm90(monkeypatch: pytest.MonkeyPatch) -> None:
    """``auto`` takes the descriptor kernel on sm_90 or later for the memory's tensors, the pointer kernel for a
    misaligned view."""
    from kdn.ops.triton.memory import intra_kernel

    monkeypatch.delenv("KDN_INTRA_KERNEL", raising=False)
    x = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    hopper = torch.cuda.get_device_capability()[0] >= 9
    assert intra_kernel(True, (x, x)) == ("tma" if hopper else "kdn")
    assert intra_kernel(True, (x, x[..., 1:])) == "kdn"
